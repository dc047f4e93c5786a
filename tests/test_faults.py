"""A run survives the SIGKILL of a rollout cell, a trainer cell and the execution worker.

One GRPO run on a real local cluster (nannies restart what is killed, as a cluster manager would
replace a node); each worker process is killed while the kind of work it holds is under way:
generations on the rollout cell, a gradient share on the trainer cell, executions on the execution
worker. The run must complete every step, with every execution archived exactly once, none dropped,
one update per step, and an archive that verifies.
"""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from distributed import Client
from support import wait_for
from test_cli import invoke

from gyreflow.cluster.local import PoolSpec, local_cluster, workers_info
from gyreflow.config import load_config
from gyreflow.recipes import grpo
from gyreflow.storage import ArchiveReader


def processing(client: Client, prefix: str) -> dict[str, list[str]]:
    """Worker name -> keys of tasks starting with ``prefix`` that it is running now."""
    def on_scheduler(dask_scheduler=None, prefix=prefix):
        out: dict[str, list[str]] = {}
        for ws in dask_scheduler.workers.values():
            keys = [str(ts.key) for ts in ws.processing if str(ts.key).startswith(prefix)]
            if keys:
                out[ws.name] = keys
        return out
    return client.run_on_scheduler(on_scheduler)


def kill(client: Client, name: str) -> None:
    """SIGKILL the worker process named ``name`` (its nanny starts a fresh one)."""
    (addr,) = [a for a, w in workers_info(client).items() if w["name"] == name]
    pid = client.run(os.getpid, workers=[addr])[addr]
    os.kill(pid, signal.SIGKILL)


def back(client: Client, n: int) -> bool:
    return len(workers_info(client)) == n


@pytest.mark.timeout(600)
def test_a_run_survives_killed_cells_and_execution_worker(tmp_path, tiny_overrides):
    steps = 6
    cfg = load_config(None, tiny_overrides + [f"rl.steps={steps}", "cluster.rollout_workers=2", "rl.tasks_per_step=3",
                                              "rl.samples_per_task=3", "agent.max_tokens_per_call=24",
                                              "rl.shares_per_group=2", "rl.eval_every=3"])
    killed: list[tuple[str, list[str]]] = []
    errors: list[BaseException] = []
    with local_cluster(PoolSpec(rollout=2, trainer=1, execution_slots=8)) as cluster, Client(cluster) as client:
        n = len(workers_info(client))

        def engine_live(name: str) -> int:
            (addr,) = [a for a, w in workers_info(client).items() if w["name"] == name]
            stats = client.run(lambda dask_worker: dask_worker.plugins["gyreflow-engine"].stats(), workers=[addr])
            return int(stats[addr]["live"] + stats[addr]["waiting"])

        def when(what: str, probe, timeout: float = 240):
            """Wait until ``probe()`` is truthy; its value then."""
            seen = []
            wait_for(lambda: seen.append(probe()) or seen[-1], timeout=timeout, what=what, every=0.01)
            return seen[-1]

        def killer() -> None:
            try:
                # A rollout cell while generations of step 1 or later run on its engine.
                when("executions of step >= 1 running",
                     lambda: any(k.split("-")[1] != "0" for k in processing(client, "execution-").get("execution-0", [])))
                killed.append(("cell-0", when("generations on cell-0", lambda: engine_live("cell-0"))))
                kill(client, "cell-0")
                when("cell-0 restarted", lambda: back(client, n), timeout=120)
                # The trainer cell while it computes a gradient share.
                killed.append(("cell-2", when("a gradient share running", lambda: processing(client, "grad-").get("cell-2"))))
                kill(client, "cell-2")
                when("cell-2 restarted", lambda: back(client, n), timeout=120)
                # The execution worker with executions under way.
                killed.append(("execution-0", when("executions running",
                                                   lambda: processing(client, "execution-").get("execution-0"))))
                kill(client, "execution-0")
            except BaseException as err:  # reported by the test thread
                errors.append(err)

        thread = threading.Thread(target=killer, daemon=True)
        thread.start()
        report = grpo.run(client, cfg, tmp_path, log=lambda *_: None)
        thread.join(timeout=60)
    assert not errors, errors
    assert [name for name, _ in killed] == ["cell-0", "cell-2", "execution-0"], killed
    assert all(keys for _, keys in killed), f"a victim held no work when killed: {killed}"

    assert report["completed"] is True
    assert [s["step"] for s in report["steps"]] == list(range(steps))
    # One update per step: versions count the steps exactly.
    assert [s["version"] for s in report["steps"]] == list(range(1, steps + 1))
    reader = ArchiveReader(tmp_path / "archive.zarr")
    assert reader.committed_steps == list(range(steps))
    per_step = cfg.rl.tasks_per_step * cfg.rl.samples_per_task
    for step in reader.committed_steps:
        train = [e for e, entry in reader.execution_index(step).items() if entry["split"] == "train"]
        assert len(train) == per_step and len(set(train)) == per_step
        for eid in train:
            ex = reader.load_execution(step, eid)
            assert not ex.dropped, (eid, ex.end_reason, ex.metrics)
            assert ex.calls, eid
            versions = np.concatenate([c.versions for c in ex.calls])
            assert versions.min() >= max(0, step - cfg.rl.staleness) and versions.max() <= step
    p = invoke("inspect", "--verify", str(tmp_path))
    assert p.returncode == 0, p.stdout
