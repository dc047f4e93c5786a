"""GRPO: an SFT warm start, then RL steps whose every stage is a Dask future.

Import it from any Dask client (``from gyreflow.recipes import grpo; grpo.run(client, cfg,
run_dir)``); ``gyreflow run`` and ``pipelines/grpo.py`` call the same function. The step graph
(executions, trees, advantages, gradient shares, update, weight publication) is
:mod:`gyreflow.stepgraph`'s; this recipe adds, as Dask tasks:

    sft-warmstart / resume-state       trainer cell     the policy the RL steps start from
    eval-v<version>-<i>                execution slots  held-out executions at that version
    archive-<step>-<group>             execution slots  a group's executions into the zarr archive
    checkpoint-<step>                  execution slots  the RL state after the step, on disk

Rollouts of step k start once the update of step k-1-staleness is published, so every trained
token is at most ``rl.staleness`` versions old. Held-out evaluation runs beside the next steps;
the engines keep the evaluated version until its executions end. A step is *committed* once its
executions, its evaluation and its checkpoint are written: the checkpoint first, then the archive
step, then ``report.json``. ``run(..., resume=True)`` continues an interrupted run directory from
its last committed step (see README, "Resume").
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from distributed import Client, Future

from gyreflow.agents.sources import TaskSource, task_source
from gyreflow.cluster.control import Timing
from gyreflow.cluster.local import check_pools, install, warm_up
from gyreflow.cluster.modes import mode as placement_mode
from gyreflow.cluster.pools import TRAINER
from gyreflow.cluster.status import describe
from gyreflow.config import RunConfig, placement_options
from gyreflow.recipes import replay
from gyreflow.recipes.common import Evaluation, end_reasons, engine_cells, engine_options, evaluate, step_args
from gyreflow.report import Report
from gyreflow.stages import (
    apply_update,
    archive_group,
    archived_trees,
    gradient_share,
    group_advantages,
    make_tree,
    publish_weights,
    run_execution,
    sft_warm_start,
    weights_of,
)
from gyreflow.stepgraph import SLOT, Group, Stages, StepFutures, publish, submit_step
from gyreflow.storage import ArchiveReader, ArchiveWriter, commit_step, create_archive
from gyreflow.storage.stores import is_url
from gyreflow.trajectory.records import RETRIED
from gyreflow.train.checkpoint import CheckpointError, load_state, read_meta, save_state, step_dir

STAGES = Stages(execute=run_execution, tree=make_tree, advantages=group_advantages, gradient=gradient_share,
                update=apply_update, weights=weights_of, publish=publish_weights, archive=archive_group,
                archived=archived_trees)
SFT_DIR = "checkpoints/sft"


@dataclass
class Driver:
    """What the recipe's functions share: the client, the config and the run's outputs."""

    client: Client
    cfg: RunConfig
    run_dir: Path
    archive: str
    report: Report
    source: TaskSource
    log: Callable[[str], object] = print
    staleness: int = 0
    evaluation: Evaluation | None = None
    """The latest held-out evaluation: the engines keep its version until it ends."""
    last_commit: float = field(default_factory=time.time)
    t_run: float = field(default_factory=time.time)


@dataclass
class StepInFlight:
    futures: StepFutures
    evaluations: list[Evaluation] = field(default_factory=list)
    """Held-out evaluations archived with this step: of the version it produced, and in the first
    step also of the starting policy."""
    checkpoint: Future | None = None
    version: int = 0

    @property
    def step(self) -> int:
        return self.futures.step

    @property
    def writes(self) -> list[Future]:
        """The groups' archive writes."""
        return self.futures.writes

    def done(self) -> bool:
        pending = [*self.writes, *([self.checkpoint] if self.checkpoint else [])]
        return all(f.done() for f in pending) and all(e.done() for e in self.evaluations)


def run(client: Client, cfg: RunConfig, run_dir: Path, log=print, cache_dir: Path | None = None,
        resume: bool = False) -> dict:
    """Run (or, with ``resume``, continue) GRPO into ``run_dir``; returns the report's data."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    check_pools(client, cfg.cluster.rollout_workers, cfg.cluster.trainer_workers, cfg.cluster.placement,
                placement_options(cfg))
    install(client, cfg.cluster.torch_threads, engine_options(cfg), cfg.cluster.placement, placement_options(cfg),
            timing=Timing(stall_s=cfg.cluster.stall_s))
    warm_up(client)
    archive = archive_location(cfg, run_dir)
    source = task_source(cfg)

    # 1. The policy the RL steps start from: the SFT warm start, or the last checkpoint.
    if resume:
        d, state, first = restart(client, cfg, run_dir, archive, source, log)
    else:
        (run_dir / "config.json").write_text(_json(cfg.to_json()))
        inside = not is_url(archive) and Path(archive).parent == run_dir
        create_archive(archive, {"config": cfg.to_json(), "pipeline": "grpo",
                                 "initial_checkpoint": SFT_DIR if inside else str((run_dir / SFT_DIR).resolve())})
        report = Report(run_dir, archive=str(archive), checkpoint=str(run_dir / "checkpoints" / "final"),
                        config=cfg.to_json(), heldout_tasks=cfg.task.heldout_tasks,
                        heldout_temperature=cfg.agent.temperature)
        d = Driver(client, cfg, run_dir, archive, report, source, log)
        log("SFT warm start on synthetic demonstrations ...")
        state = client.submit(sft_warm_start, cfg, str(run_dir / SFT_DIR), str(cache_dir) if cache_dir else None,
                              run_dir.name, key="sft-warmstart", resources={TRAINER: 1})
        first = 0
    d.staleness = placement_mode(cfg.cluster.placement).staleness(cfg.rl.staleness)
    version = state.result().version
    if not resume:
        d.report.set(sft=state.result().metrics)
    published = client.submit(weights_of, state, key=f"weights-v{version}")
    publish(client, STAGES, published, engine_cells(client, cfg), version=version)
    if first == 0:  # the starting policy's held-out executions are archived with step 0
        d.evaluation = evaluate(client, source.heldout(), source, cfg, version, archive, step=0)

    # 2. RL steps, overlapped up to the staleness bound; committed in order as they complete.
    d.report.placement_since(client.sync(client.scheduler.gyreflow_pools))
    in_flight: deque[StepInFlight] = deque()
    trained: deque[StepInFlight] = deque()
    for step in range(first, cfg.rl.steps):
        while in_flight and in_flight[0].step <= step - d.staleness - 1:
            trained.append(close(d, in_flight.popleft()))
            commit_ready(d, trained)
        in_flight.append(launch(d, step, state, published))
        if step == first and d.evaluation is not None:
            in_flight[-1].evaluations.append(d.evaluation)
        state, published = in_flight[-1].futures.update, in_flight[-1].futures.published
    while in_flight:
        trained.append(close(d, in_flight.popleft()))
    commit_ready(d, trained, block=True)
    client.submit(save_state, state, str(run_dir / "checkpoints" / "final"), cfg.rl.steps - 1,
                  key="checkpoint-final", resources=SLOT).result()
    d.report.set(total_wall_s=time.time() - d.t_run, completed=True,
                 placement=client.sync(client.scheduler.gyreflow_pools))
    return d.report.data


def archive_location(cfg: RunConfig, run_dir: Path) -> str:
    """Where the run's archive lives (``storage.archive``; default inside the run directory)."""
    return cfg.storage.archive.replace("{run}", run_dir.name) if cfg.storage.archive else str(run_dir / "archive.zarr")


def restart(client: Client, cfg: RunConfig, run_dir: Path, archive: str, source: TaskSource, log):
    """Continue from the last committed step with a checkpoint: the archive drops what no commit
    covers, committed steps after the checkpoint are trained again from the archive (never run
    again), and the run goes on from the next step."""
    writer = ArchiveWriter.open(archive)  # discards uncommitted steps, rolls half-committed ones forward
    committed = writer.committed_steps
    ckpts = {s: p for s, p in checkpoints(run_dir).items() if s in committed}
    base = max(ckpts) if ckpts else None
    report = Report.reopen(run_dir, committed)
    reader = ArchiveReader(archive)
    have = {e["step"] for e in report.data["steps"]}
    for step in committed:  # committed, but the driver died before the report said so
        if step not in have:
            report.data["steps"].append({"step": step, **reader.summary(step), "restored_from_archive": True})
    report.data["steps"].sort(key=lambda e: e["step"])
    d = Driver(client, cfg, run_dir, archive, report, source, log)
    if base is not None:
        log(f"resuming from the checkpoint of step {base} ({ckpts[base]})")
        state = client.submit(load_state, str(ckpts[base]), key=f"resume-state-{base}", resources={TRAINER: 1})
    elif (run_dir / SFT_DIR / "config.json").is_file():
        log(f"resuming from the SFT policy ({run_dir / SFT_DIR})")
        state = client.submit(replay.initial_state, str(run_dir / SFT_DIR), run_dir.name, key="resume-state-sft",
                              resources={TRAINER: 1})
        state = client.submit(replay.with_optim, state, cfg.optim, key="resume-optim")
    else:
        raise CheckpointError(f"{run_dir} has no checkpoint to resume from (the run stopped before its SFT policy "
                              f"was saved): remove the directory and start the run again")
    redo = [s for s in committed if base is None or s > base]
    if redo:
        log(f"training committed steps {redo} again from the archive")
        published = client.submit(weights_of, state, key="resume-weights")
        for step in redo:
            futures = replay.submit_replayed_step(client, reader, step, cfg, state, published)
            if futures is not None:
                state, published = futures.update, futures.published
    resumes = report.data.setdefault("resumes", [])
    resumes.append({"at": time.time(), "checkpoint_step": base, "retrained_steps": redo,
                    "first_step": (max(committed) + 1) if committed else 0})
    report.write()
    return d, state, (max(committed) + 1) if committed else 0


def checkpoints(run_dir: Path) -> dict[int, Path]:
    """Readable step checkpoints of a run directory, by step."""
    out = {}
    for path in sorted((run_dir / "checkpoints").glob("step-*")):
        try:
            out[read_meta(path)["step"]] = path
        except CheckpointError:
            continue  # damaged: an older one serves
    return out


def launch(d: Driver, step: int, state: Future, published: Future) -> StepInFlight:
    """Submit one step's tasks and its executions' archive writes."""
    cfg, client = d.cfg, d.client
    tasks = d.source.train(step, cfg.rl.tasks_per_step)
    groups = [
        Group(name, [(eid := f"execution-{step}-{name}-{sample}",
                      (task, d.source.agent(), eid, step, sample, cfg.rl.seed, cfg.rl.retries))
                     for sample in range(cfg.rl.samples_per_task)])
        for name, task in zip(group_names(tasks), tasks)
    ]
    # Each group is archived (one segment, from the trees built for training) before it trains,
    # and trains what was archived.
    futures = submit_step(client, step, groups, STAGES, state, published, archive=str(d.archive), **step_args(cfg))
    return StepInFlight(futures)


def group_names(tasks) -> list[str]:
    """A name per group: the task id, suffixed ``.r`` when a small suite repeats a task in a step."""
    seen: dict[str, int] = {}
    names = []
    for task in tasks:
        r = seen[task.task_id] = seen.get(task.task_id, -1) + 1
        names.append(task.task_id if r == 0 else f"{task.task_id}.{r}")
    return names


def close(d: Driver, sf: StepInFlight) -> StepInFlight:
    """The step's update is done: publish it (once the previous evaluation has ended), start its
    held-out evaluation and its checkpoint; nothing here waits for them."""
    cfg, client = d.cfg, d.client
    sf.version = sf.futures.update.result().version
    if d.evaluation is not None:
        d.evaluation.wait()  # its executions must see one version throughout
    publish(client, STAGES, sf.futures.published, engine_cells(client, cfg), sf.version)
    if (sf.step + 1) % cfg.rl.eval_every == 0 or sf.step == cfg.rl.steps - 1:
        d.evaluation = evaluate(client, d.source.heldout(), d.source, cfg, sf.version, d.archive, sf.step)
        sf.evaluations.append(d.evaluation)
    if (sf.step + 1) % cfg.rl.checkpoint_every == 0 or sf.step == cfg.rl.steps - 1:
        sf.checkpoint = client.submit(save_state, sf.futures.update, str(step_dir(d.run_dir / "checkpoints", sf.step)),
                                      sf.step, key=f"checkpoint-{sf.step}", resources=SLOT)
    return sf


def commit_ready(d: Driver, trained: deque[StepInFlight], block: bool = False) -> None:
    """Commit trained steps in order, as long as the first one's writes are done (all, with ``block``)."""
    while trained and (block or trained[0].done()):
        commit(d, trained.popleft())


def commit(d: Driver, sf: StepInFlight) -> None:
    """Checkpoint on disk, then the archive step, then the report entry; log the step."""
    client, cfg = d.client, d.cfg
    # Figures from what the archive holds (a re-run after a worker died is not what was trained).
    written = [s for group in client.gather(sf.writes) for s in group]
    judged = [s for s in written if s["end_reason"] not in RETRIED] or written
    ev = {"pass_rate": None, "mean_reward": None}
    for evaluation in sf.evaluations:
        if evaluation.version == sf.version:
            ev = evaluation.summary(client)
        else:  # the starting policy's
            start = evaluation.summary(client)
            d.report.set(initial_heldout_pass_rate=start["pass_rate"], initial_heldout_mean_reward=start["mean_reward"])
            d.log(f"starting policy: held-out pass rate {start['pass_rate']:.3f} (mean reward {start['mean_reward']:.3f})")
    eval_writes = [f for e in sf.evaluations for f in e.writes]
    summaries = written + [s for group in client.gather(eval_writes) for s in group]
    if sf.checkpoint is not None:
        sf.checkpoint.result()
    tokens = int(sum(s["n_completion_tokens"] for s in written))
    summary = {"version": sf.version, "heldout_pass_rate": ev["pass_rate"],
               "mean_reward": float(np.mean([s["reward"] for s in judged])), "tokens_generated": tokens,
               "end_reasons": end_reasons(written)}
    commit_step(str(d.archive), sf.step, summary, expected=[s["execution_id"] for s in summaries])
    prune_checkpoints(d.run_dir, cfg.rl.keep_checkpoints)
    now = time.time()
    m = sf.futures.update.result().metrics
    entry = {
        "step": sf.step,
        "version": sf.version,
        "heldout_pass_rate": ev["pass_rate"],
        "heldout_mean_reward": ev["mean_reward"],
        "mean_reward": summary["mean_reward"],
        "train_pass_rate": float(np.mean([s["passed"] for s in judged])),
        "tokens_generated": tokens,
        "end_reasons": summary["end_reasons"],
        "heldout_end_reasons": ev.get("end_reasons"),
        "wall_s": now - d.last_commit,
        "elapsed_s": now - d.t_run,
        "max_staleness": m.get("max_staleness", 0),
        "train": {k: m[k] for k in ("trained_tokens", "padded_tokens", "stale_masked", "grad_norm", "clip_frac",
                                    "approx_kl", "update_kl", "update_kl_proposed", "update_scale", "train_s", "shares",
                                    "share_workers") if k in m},
        "placement": d.report.placement_since(client.sync(client.scheduler.gyreflow_pools)),
    }
    d.last_commit = now
    d.report.add_step(entry)
    held = "-" if ev["pass_rate"] is None else f"{ev['pass_rate']:.3f}"
    d.log(f"step {sf.step + 1}/{cfg.rl.steps}: held-out pass {held}  train reward {entry['mean_reward']:.3f}  "
          f"tokens {tokens}  staleness {entry['max_staleness']}  trained on {len(m.get('share_workers', []))} cell(s)  "
          f"{entry['wall_s']:.1f}s")
    if m.get("update_scale", 1.0) < 1.0:
        d.log(f"  update cut to {m['update_scale']:g} of the step: KL {m['update_kl_proposed']:.3f} -> "
              f"{m['update_kl']:.3f} (rl.max_update_kl {cfg.rl.max_update_kl:g})")
    d.log(f"  placement: {describe(entry['placement'])}")


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete step checkpoints beyond the newest ``keep`` (0: keep all)."""
    import shutil

    if keep <= 0:
        return
    found = sorted(checkpoints(run_dir).items())
    for _, path in found[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


def _json(data) -> str:
    import json

    return json.dumps(data, indent=1) + "\n"
