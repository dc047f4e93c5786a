"""GRPO on the vault tasks: an SFT warm start, then RL steps whose every stage is a Dask future.

The step graph (executions, trees, advantages, gradient shares, update, weight publication) is
:mod:`gyreflow.stepgraph`'s; this driver adds the held-out evaluation and the zarr archive:

    sft-warmstart                      trainer cell     the SFT policy -> RL state of version 0
    eval-v<version>-<i>                execution slots  held-out executions at that version
    archive-<execution>                execution slots  an execution's calls into the zarr archive

A step is committed to the archive (training executions, and the held-out executions of the
version it produced) only when all of its writes are done.

Rollouts of step k start once the update of step k-1-staleness is published, so every trained
token is at most ``rl.staleness`` versions old. Cells move between the rollout and trainer pools
as ``cluster.placement`` says (the scheduler plugin applies it while everything runs).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from distributed import Client, Future

from gyreflow.agents.sources import TaskSource, task_source
from gyreflow.cluster.control import Timing
from gyreflow.cluster.local import cells_of, check_pools, install
from gyreflow.cluster.modes import mode as placement_mode
from gyreflow.cluster.pools import ROLLOUT, TRAINER
from gyreflow.cluster.status import describe
from gyreflow.config import RunConfig, placement_options
from gyreflow.report import Report
from gyreflow.stages import (
    apply_update,
    gradient_share,
    group_advantages,
    make_tree,
    publish_weights,
    run_execution,
    save_checkpoint,
    sft_warm_start,
    weights_of,
)
from gyreflow.stepgraph import SLOT, Group, Stages, StepFutures, publish, submit_step
from gyreflow.storage import commit_step, create_archive, write_executions
from gyreflow.model.tokenizer import VOCAB_SIZE
from gyreflow.trajectory.records import END_REASONS

STAGES = Stages(execute=run_execution, tree=make_tree, advantages=group_advantages, gradient=gradient_share,
                update=apply_update, weights=weights_of, publish=publish_weights)


@dataclass
class StepInFlight:
    futures: StepFutures
    writes: list[Future]

    @property
    def step(self) -> int:
        return self.futures.step


def run(client: Client, cfg: RunConfig, run_dir: Path, log=print, cache_dir: Path | None = None) -> dict:
    run_dir = Path(run_dir)
    check_pools(client, cfg.cluster.rollout_workers, cfg.cluster.trainer_workers, cfg.cluster.placement,
                placement_options(cfg))
    install(client, cfg.cluster.torch_threads, engine_options(cfg), cfg.cluster.placement, placement_options(cfg),
            timing=Timing(stall_s=cfg.cluster.stall_s))
    staleness = placement_mode(cfg.cluster.placement).staleness(cfg.rl.staleness)
    archive = run_dir / "archive.zarr"
    create_archive(archive, run_meta={"config": cfg.to_json(), "pipeline": "grpo"})
    report = Report(run_dir, archive=str(archive), checkpoint=str(run_dir / "checkpoints" / "final"),
                    config=cfg.to_json(), heldout_tasks=cfg.task.heldout_tasks, heldout_temperature=cfg.agent.temperature)
    t_run = time.time()
    source = task_source(cfg)
    heldout = source.heldout()

    # 1. SFT warm start on a trainer cell; its weights become version 0 on every engine.
    log("SFT warm start on synthetic demonstrations ...")
    state = client.submit(sft_warm_start, cfg, str(run_dir / "checkpoints" / "sft"),
                          str(cache_dir) if cache_dir else None, run_dir.name, key="sft-warmstart", resources={TRAINER: 1})
    published = client.submit(weights_of, state, key="weights-v0")
    publish(client, STAGES, published, engine_cells(client, cfg), version=0)
    sft = state.result().metrics
    initial, initial_writes = evaluate(client, heldout, source, cfg, version=0, archive=archive, step=0)
    report.set(initial_heldout_pass_rate=initial["pass_rate"], initial_heldout_mean_reward=initial["mean_reward"], sft=sft)
    log(f"SFT policy: held-out pass rate {initial['pass_rate']:.3f} (mean reward {initial['mean_reward']:.3f})")

    # 2. RL steps, overlapped up to the staleness bound.
    report.placement_since(client.sync(client.scheduler.gyreflow_pools))  # where each step's placement starts from
    in_flight: deque[StepInFlight] = deque()
    last_finish = time.time()
    for step in range(cfg.rl.steps):
        while in_flight and in_flight[0].step <= step - staleness - 1:
            last_finish = finish(client, in_flight.popleft(), cfg, heldout, source, archive, report, log, last_finish, t_run)
        in_flight.append(launch(client, step, cfg, source, archive, state, published))
        if step == 0:  # the SFT policy's held-out executions are archived with step 0
            in_flight[0].writes.extend(initial_writes)
        state, published = in_flight[-1].futures.update, in_flight[-1].futures.published
    while in_flight:
        last_finish = finish(client, in_flight.popleft(), cfg, heldout, source, archive, report, log, last_finish, t_run)
    save_checkpoint(state.result().published, str(run_dir / "checkpoints" / "final"))
    report.set(total_wall_s=time.time() - t_run, completed=True,
               placement=client.sync(client.scheduler.gyreflow_pools))
    return report.data


def engine_options(cfg: RunConfig) -> dict:
    ctx = cfg.agent.max_context_tokens + cfg.agent.max_tokens_per_call + 64
    return {"max_batch": cfg.cluster.engine_max_batch, "max_seq_len": ctx,
            "retain_slots": 2 * cfg.cluster.engine_max_batch}


def engine_cells(client: Client, cfg: RunConfig) -> list[str]:
    """Cells whose engines get each weights version: those that may roll out in this mode."""
    pools = cells_of(client)
    return pools[ROLLOUT] + (pools[TRAINER] if placement_mode(cfg.cluster.placement).trainers_roll_out else [])


def launch(client: Client, step: int, cfg: RunConfig, source: TaskSource, archive: Path, state: Future,
           published: Future) -> StepInFlight:
    """Submit one step's tasks and its executions' archive writes."""
    tasks = source.train(step, cfg.rl.tasks_per_step)
    groups = [
        Group(name, [(eid := f"execution-{step}-{name}-{sample}",
                      (task, source.agent(), eid, step, sample, cfg.rl.seed, cfg.rl.retries))
                     for sample in range(cfg.rl.samples_per_task)])
        for name, task in zip(group_names(tasks), tasks)
    ]
    loss_kwargs = {"clip_eps": cfg.rl.clip_eps, "clip_eps_high": cfg.rl.clip_eps_high or None,
                   "clip_ratio_c": cfg.rl.clip_ratio_c or None}
    staleness = placement_mode(cfg.cluster.placement).staleness(cfg.rl.staleness)
    futures = submit_step(client, step, groups, STAGES, state, published,
                          advantage_args=(cfg.rl.advantage, cfg.rl.j_max, cfg.rl.aggregation, cfg.rl.seed,
                                          cfg.rl.tree_training),
                          gradient_args=(cfg.rl.loss, loss_kwargs, staleness, cfg.rl.is_cap),
                          shares_per_group=cfg.rl.shares_per_group,
                          tree_args=(VOCAB_SIZE, cfg.model.max_position_embeddings))
    # One archive segment per group, written once the group's executions are done, from the trees
    # built for training.
    writes, at = [], 0
    for k, g in enumerate(groups):
        done, trees = (f[at : at + len(g.executions)] for f in (futures.executions, futures.trees))
        at += len(g.executions)
        writes.append(client.submit(write_executions, str(archive), done, f"group-{k:04d}",  # task ids may not be path-safe
                                    trees, key=f"archive-{step}-{g.task_id}", resources=SLOT))
    return StepInFlight(futures, writes)


def group_names(tasks) -> list[str]:
    """A name per group: the task id, suffixed ``.r`` when a small suite repeats a task in a step."""
    seen: dict[str, int] = {}
    names = []
    for task in tasks:
        r = seen[task.task_id] = seen.get(task.task_id, -1) + 1
        names.append(task.task_id if r == 0 else f"{task.task_id}.{r}")
    return names


def evaluate(client: Client, heldout, source: TaskSource, cfg: RunConfig, version: int, archive: Path,
             step: int) -> tuple[dict, list[Future]]:
    """Pass rate and mean reward of the policy now on the engines, on the held-out tasks; and the
    writes of those executions (split ``heldout``) into the archive's ``step``."""
    futures = []
    for i, task in enumerate(heldout):
        eid = f"eval-v{version}-{i}"
        futures.append(client.submit(run_execution, task, source.agent(), eid, step, 0, cfg.rl.seed, cfg.rl.retries,
                                     key=eid, resources=SLOT))
    writes = [client.submit(write_executions, str(archive), futures, f"eval-v{version}", key=f"archive-eval-v{version}",
                            resources=SLOT)]
    results = client.gather(futures)
    # Executions the system failed are no verdict on the policy: rates are over the others.
    judged = [r for r in results if not r.dropped] or results
    summary = {"pass_rate": float(np.mean([r.passed for r in judged])),
               "mean_reward": float(np.mean([r.reward for r in judged])), "end_reasons": end_reasons(results)}
    return summary, writes


def end_reasons(results) -> dict[str, int]:
    """How many executions ended with each reason (every reason listed, zeros included)."""
    return {reason: sum(r.end_reason == reason for r in results) for reason in END_REASONS}


def finish(client, sf: StepInFlight, cfg, heldout, source, archive, report, log, last_finish, t_run) -> float:
    """Publish the step's update, evaluate it, commit the step to the archive and the report (with
    what the pools did since the last step finished)."""
    trained = sf.futures.update.result()
    version = trained.version
    publish(client, STAGES, sf.futures.published, engine_cells(client, cfg), version)
    if (sf.step + 1) % cfg.rl.eval_every == 0 or sf.step == cfg.rl.steps - 1:
        ev, eval_writes = evaluate(client, heldout, source, cfg, version, archive, sf.step)
    else:  # not evaluated at this step
        ev, eval_writes = {"pass_rate": None, "mean_reward": None}, []
    results = client.gather(sf.futures.executions)
    judged = [r for r in results if not r.dropped] or results
    summaries = [s for written in client.gather(sf.writes + eval_writes) for s in written]
    tokens = int(sum(r.tokens_generated for r in results))
    summary = {"version": version, "heldout_pass_rate": ev["pass_rate"],
               "mean_reward": float(np.mean([r.reward for r in judged])), "tokens_generated": tokens,
               "end_reasons": end_reasons(results)}
    commit_step(str(archive), sf.step, summary, expected=[s["execution_id"] for s in summaries])
    now = time.time()
    m = trained.metrics
    entry = {
        "step": sf.step,
        "version": version,
        "heldout_pass_rate": ev["pass_rate"],
        "heldout_mean_reward": ev["mean_reward"],
        "mean_reward": summary["mean_reward"],
        "train_pass_rate": float(np.mean([r.passed for r in judged])),
        "tokens_generated": tokens,
        "end_reasons": summary["end_reasons"],
        "heldout_end_reasons": ev.get("end_reasons"),
        "wall_s": now - last_finish,
        "elapsed_s": now - t_run,
        "max_staleness": m.get("max_staleness", 0),
        "train": {k: m[k] for k in ("trained_tokens", "padded_tokens", "stale_masked", "grad_norm", "clip_frac",
                                    "approx_kl", "train_s", "shares", "share_workers") if k in m},
    }
    entry["placement"] = report.placement_since(client.sync(client.scheduler.gyreflow_pools))
    report.add_step(entry)
    held = "-" if ev["pass_rate"] is None else f"{ev['pass_rate']:.3f}"
    log(f"step {sf.step + 1}/{cfg.rl.steps}: held-out pass {held}  train reward {entry['mean_reward']:.3f}  "
        f"tokens {tokens}  staleness {entry['max_staleness']}  trained on {len(m.get('share_workers', []))} cell(s)  "
        f"{entry['wall_s']:.1f}s")
    log(f"  placement: {describe(entry['placement'])}")
    return now
