"""The GRPO pipeline on a real local Dask cluster: worker processes with per-worker resources."""

import subprocess
import sys

import numpy as np
import pytest
import zarr
from distributed import Client

from gyreflow.cli import find_pipeline
from gyreflow.cluster.local import PoolSpec, check_pools, local_cluster, warm_up, workers_info
from gyreflow.config import load_config
from gyreflow.storage import ArchiveReader
from support import wait_for


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(PoolSpec(rollout=1, trainer=1, execution_slots=8)) as c:
        yield c


def test_workers_import_the_stage_libraries_before_the_first_task(cluster):
    """Run first on the module's fresh cluster: nothing has imported the model code there yet. A
    worker of the same cluster with no gyreflow resource (a shared cluster's) is left alone."""
    def loaded() -> tuple[bool, bool]:
        import sys

        return "torch" in sys.modules, "transformers.models.llama.modeling_llama" in sys.modules

    foreign = subprocess.Popen([sys.executable, "-m", "dask", "worker", cluster.scheduler_address, "--name", "foreign",
                                "--no-dashboard", "--no-nanny"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with Client(cluster) as client:
            client.wait_for_workers(4, timeout=120)
            assert set(client.run(loaded).values()) == {(False, False)}
            warm_up(client)
            now = {info["name"]: client.run(loaded, workers=[addr])[addr] for addr, info in workers_info(client).items()}
            assert now == {"cell-0": (True, True), "cell-1": (True, True), "execution-0": (True, True),
                           "foreign": (False, False)}, now
    finally:
        foreign.terminate()
        foreign.wait(timeout=60)
    with Client(cluster) as client:
        wait_for(lambda: len(workers_info(client)) == 3, timeout=60, what="the foreign worker gone")


def test_two_steps_run_each_stage_only_on_its_pool(cluster, tmp_path, tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["rl.eval_every=1"])
    with Client(cluster) as client:
        pools = check_pools(client)
        client.get_task_stream()  # the first call installs the scheduler's task-stream recorder
        report = find_pipeline("grpo").run(client, cfg, tmp_path, log=lambda *_: None)
        stream = client.get_task_stream(start=0)
        engine_stats = client.run(lambda dask_worker: dask_worker.plugins["gyreflow-engine"].stats())

    assert [s["step"] for s in report["steps"]] == [0, 1]
    assert report["steps"][1]["max_staleness"] <= cfg.rl.staleness
    assert report["completed"] is True

    # Every stage ran only on workers whose resources allow it.
    where = {}
    for t in stream:
        where.setdefault(t["key"].split("-")[0], set()).add(t["worker"])
    exec_pool, rollout, trainer = set(pools["execution"]), set(pools["rollout"]), set(pools["trainer"])
    for prefix in ("execution", "eval", "tree", "advantages", "archive"):
        assert where[prefix] and where[prefix] <= exec_pool, prefix
    assert where["grad"] <= trainer and where["update"] <= trainer and where["sft"] <= trainer
    assert where["publish"] <= rollout | trainer
    # Engine work: only the rollout cell's engine generated tokens.
    for addr, stats in engine_stats.items():
        assert (stats.get("tokens_generated", 0) > 0) == (addr in rollout)

    # The archive holds both steps, and every recorded call was served by a rollout engine.
    reader = ArchiveReader(tmp_path / "archive.zarr")
    assert reader.committed_steps == [0, 1]
    n_train = cfg.rl.tasks_per_step * cfg.rl.samples_per_task
    for step in (0, 1):
        ids = reader.executions(step)
        train_ids = [i for i in ids if i.startswith("execution-")]
        eval_ids = [i for i in ids if i.startswith("eval-")]
        assert len(train_ids) == n_train
        # Held-out executions of the version the step produced (and, in step 0, of the SFT policy).
        assert len(eval_ids) == cfg.task.heldout_tasks * (2 if step == 0 else 1)
        for eid in eval_ids:
            assert reader.load_execution(step, eid).split == "heldout"
        for eid in train_ids:
            ex = reader.load_execution(step, eid)
            assert ex.worker in exec_pool
            assert not ex.dropped, ex.metrics  # nothing fails in a healthy run
            assert ex.calls and all(c.engine in rollout for c in ex.calls), (ex.end_reason, ex.metrics)
            # Step k's rollouts start once version k - staleness is published, and version k+1
            # needs their own update: every token's version lies in between.
            versions = np.concatenate([c.versions for c in ex.calls])
            assert versions.min() >= max(0, step - cfg.rl.staleness) and versions.max() <= step
    # Plain zarr sees the same committed steps.
    root = zarr.open_group(str(tmp_path / "archive.zarr"), mode="r")
    assert list(root.attrs["committed_steps"]) == [0, 1]
    assert (tmp_path / "report.json").is_file() and (tmp_path / "checkpoints" / "final" / "config.json").is_file()


def test_on_policy_staleness_zero(cluster, tmp_path, tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["rl.staleness=0", "rl.steps=3", "rl.eval_every=2"])
    with Client(cluster) as client:
        report = find_pipeline("grpo").run(client, cfg, tmp_path, log=lambda *_: None)
    assert [s["max_staleness"] for s in report["steps"]] == [0, 0, 0]
    # Held-out evaluation after every second step and after the last: steps 1 and 2 (and the SFT policy).
    assert [s["heldout_pass_rate"] is None for s in report["steps"]] == [True, False, False]
    reader = ArchiveReader(tmp_path / "archive.zarr")
    evals = {step: sum(e.startswith("eval-") for e in reader.executions(step)) for step in reader.committed_steps}
    assert evals == {0: cfg.task.heldout_tasks, 1: cfg.task.heldout_tasks, 2: cfg.task.heldout_tasks}
    # On-policy: every token of step k's executions was sampled by weights version k.
    for step in reader.committed_steps:
        for eid in reader.executions(step):
            if not eid.startswith("execution-"):
                continue
            ex = reader.load_execution(step, eid)
            assert np.all(np.concatenate([c.versions for c in ex.calls]) == step)


def test_suite_tasks_train_the_unmodified_example_agent(tmp_path, tiny_overrides):
    """``task.suite``: the example agent program (only the openai SDK) is demonstrated to through
    the proxy for the SFT warm start, then run as external executions whose recorded calls are
    trained on. (A cluster of its own: engines keep the context length of the first run they served.)"""
    overrides = [o for o in tiny_overrides if not o.startswith(("task.", "agent.max_context"))] + [
        "task.suite=examples/repo_tasks", "task.heldout_tasks=2", "agent.max_context_tokens=3000",
        "rl.tasks_per_step=2", "external.max_calls=3", "external.max_tokens_per_call=200",
        'external.env={"AGENT_MAX_TURNS": "3", "AGENT_MAX_TOKENS": "200"}']
    cfg = load_config(None, overrides)
    with local_cluster(PoolSpec(rollout=1, trainer=1, execution_slots=8)) as cluster, Client(cluster) as client:
        report = find_pipeline("grpo").run(client, cfg, tmp_path, log=lambda *_: None)
    assert report["completed"] and report["sft"]["demos"] == 4 and report["sft"]["demo_pass_rate"] == 1.0
    reader = ArchiveReader(tmp_path / "archive.zarr")
    assert reader.committed_steps == [0, 1]
    train = [reader.load_execution(1, e) for e in reader.executions(1) if e.startswith("execution-")]
    assert {ex.task_id for ex in train} == {"greet", "largest"}  # the suite's train tasks, in turn
    for ex in train:
        assert ex.calls and len(ex.calls) <= 3 and ex.end_reason in ("done", "budget", "policy_crash")
        assert ex.metrics["returncode"] is not None and 0.0 <= ex.reward <= 1.0
        versions = np.concatenate([c.versions for c in ex.calls])
        assert versions.min() >= 0 and versions.max() <= 1
    assert [s["version"] for s in report["steps"]] == [1, 2]
    # A step trains its executions' recorded completions where a group (one task's executions)
    # has signal: calls made and rewards that differ. Otherwise the update is empty.
    for entry in report["steps"]:
        groups: dict[str, list] = {}
        for e in reader.executions(entry["step"]):
            if e.startswith("execution-"):
                ex = reader.load_execution(entry["step"], e)
                if not ex.dropped:
                    groups.setdefault(ex.task_id, []).append(ex)
        signal = any(len({ex.reward for ex in g}) > 1 and any(ex.calls for ex in g) for g in groups.values())
        assert (entry["train"]["trained_tokens"] > 0) == signal


def test_a_run_needing_longer_contexts_than_the_engines_hold_is_refused(cluster, tiny_overrides):
    """Engines keep the options of the first run on a cluster: a later run whose prompts they
    cannot hold is refused up front, with what to do."""
    from gyreflow.cluster.local import ClusterError, install

    grpo = find_pipeline("grpo")
    cfg = load_config(None, tiny_overrides)
    with Client(cluster) as client:
        install(client, 1, grpo.engine_options(cfg), "async")
        install(client, 1, grpo.engine_options(cfg), "async")  # the same needs: fine
        longer = load_config(None, tiny_overrides + ["agent.max_context_tokens=4000"])
        with pytest.raises(ClusterError, match="fresh cluster"):
            install(client, 1, grpo.engine_options(longer), "async")
