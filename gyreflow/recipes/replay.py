"""Replay: train again from a trajectory archive, with no engine and no rollout.

Each committed step of the archive becomes the same step graph as online (trees, group
advantages, gradient shares, update), its executions read from the archive instead of run:

    replay-init                        trainer cell     the run's initial policy -> RL state
    execution-<step>-...               execution slot   an archived execution, read back token-exact
    tree-... advantages-... grad-... update-<step>      as in a run (see gyreflow.stepgraph)

Steps go in the archive's order; groups are the archive's segments of training executions, in the
order the run wrote them. With the run's own config, replaying an on-policy run reproduces its
weights (the same samples, seeds and updates); any algorithm field can be changed with
``--set`` (estimator, loss, J_max, aggregation, learning rate...).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
from distributed import Client, Future

from gyreflow.cluster.local import install_trainers
from gyreflow.cluster.modes import mode as placement_mode
from gyreflow.cluster.pools import TRAINER
from gyreflow.config import RunConfig, config_from
from gyreflow.recipes.common import step_args
from gyreflow.report import Report
from gyreflow.stages import (
    apply_update,
    archived_execution,
    gradient_share,
    group_advantages,
    make_tree,
    publish_weights,
    weights_of,
)
from gyreflow.stepgraph import Group, Stages, StepFutures, submit_step
from gyreflow.storage import ArchiveReader
from gyreflow.storage.schema import ARCHIVE_NAME
from gyreflow.storage.stores import is_url
from gyreflow.train.checkpoint import CheckpointError, load_state, save_state
from gyreflow.train.state import PolicyState, PublishedWeights

STAGES = Stages(execute=archived_execution, tree=make_tree, advantages=group_advantages, gradient=gradient_share,
                update=apply_update, weights=weights_of, publish=publish_weights)


def archive_of(path: str | Path) -> str:
    """The archive named by ``path``: an archive (a directory or a URL), or a run directory (its
    ``archive.zarr``, or the archive its report names)."""
    if is_url(path):
        return str(path)
    path = Path(path)
    if (path / ARCHIVE_NAME).is_dir():
        return str(path / ARCHIVE_NAME)
    report = path / "report.json"
    if report.is_file():
        try:
            named = json.loads(report.read_text()).get("archive")
        except json.JSONDecodeError:
            named = None
        if named:
            return str(named)
    return str(path)


def replay_config(reader: ArchiveReader, overrides: list[str] | None = None) -> RunConfig:
    """The config the archive's run stored, with ``overrides``.

    Raises
    ------
    gyreflow.config.ConfigError
        If an override is invalid, or the archive stores no config (then every field is the default).
    """
    from gyreflow.config import ConfigError

    stored = reader.run.get("config")
    if not isinstance(stored, dict):
        raise ConfigError(f"archive {reader.path!r} stores no run config; it was not written by gyreflow run")
    return config_from(stored, overrides)


def initial_checkpoint(reader: ArchiveReader) -> Path | None:
    """The policy the archive's run started its RL steps from, where the run recorded it."""
    rel = reader.run.get("initial_checkpoint")
    if not rel:
        return None
    return Path(rel) if Path(rel).is_absolute() or is_url(reader.path) else Path(reader.path).parent / rel


def initial_state(path: str, run: str) -> PolicyState:
    """The RL state to replay from: an RL checkpoint, or a Hugging Face policy with a fresh
    optimizer at version 0."""
    from gyreflow.model.policy import load_policy, state_dict_numpy

    try:
        state = load_state(path)
        return PolicyState(PublishedWeights(state.version, run, state.published.hf_config, state.published.weights,
                                            state.published.optim), state.optimizer, state.metrics)
    except CheckpointError:
        pass
    model = load_policy(path)
    return PolicyState(PublishedWeights(0, run, model.config.to_dict(), state_dict_numpy(model)), None, {})


def with_optim(state: PolicyState, optim) -> PolicyState:
    """``state`` training with the optimizer settings ``optim`` (the replay's config)."""
    p = state.published
    return PolicyState(PublishedWeights(p.version, p.run, p.hf_config, p.weights, optim), state.optimizer, state.metrics)


def train_groups(reader: ArchiveReader, archive: str, step: int) -> list[Group]:
    """The step's training executions as the run grouped them: one group per segment, in the
    order the run wrote them, executions by sample."""
    by_segment: dict[str, list[tuple[int, str]]] = {}
    for eid, entry in reader.execution_index(step).items():
        if entry.get("split") == "train":
            by_segment.setdefault(str(entry.get("segment", eid)), []).append((int(entry.get("sample") or 0), eid))
    return [Group(name, [(eid, (archive, step, eid)) for _, eid in sorted(members)])
            for name, members in sorted(by_segment.items())]


def submit_replayed_step(client: Client, reader: ArchiveReader, step: int, cfg: RunConfig, state: Future,
                         published: Future, tag: str = "") -> StepFutures | None:
    """One archived step's training as Dask futures (``None`` when it holds no training execution);
    ``tag`` ends every key (see :func:`gyreflow.stepgraph.submit_step`)."""
    groups = train_groups(reader, reader.path if is_url(reader.path) else str(Path(reader.path).resolve()), step)
    if not groups:
        return None
    return submit_step(client, step, groups, STAGES, state, published, tag=tag, **step_args(cfg))


def run(client: Client, cfg: RunConfig, archive: str | Path, out_dir: str | Path, init: str | Path | None = None,
        log=print, steps: list[int] | None = None, evaluate: bool = False) -> dict:
    """Replay ``archive``'s committed steps (or ``steps``) with ``cfg``; writes ``out_dir/report.json``
    and ``out_dir/checkpoints/final`` (Hugging Face format with the optimizer and RL state). With
    ``evaluate``, the final policy then runs the held-out tasks on the cluster's rollout cells."""
    out_dir, reader = Path(out_dir), ArchiveReader(archive_of(archive))
    out_dir.mkdir(parents=True, exist_ok=True)
    install_trainers(client, cfg.cluster.torch_threads)
    init = Path(init) if init else initial_checkpoint(reader)
    if init is None or not (init / "config.json").is_file():
        raise FileNotFoundError(f"no initial policy for archive {reader.path!r} (looked for {init}); pass --init DIR")
    steps = reader.committed_steps if steps is None else steps
    report = Report(out_dir, archive=reader.path if is_url(reader.path) else str(Path(reader.path).resolve()),
                    replayed_steps=steps, init=str(init),
                    config=cfg.to_json(), checkpoint=str(out_dir / "checkpoints" / "final"))
    t0 = time.time()
    tag = f"@{out_dir.name}-{uuid.uuid4().hex[:6]}"  # replays of one archive may share a cluster
    state = client.submit(initial_state, str(init), out_dir.name, key=f"replay-init{tag}", resources={TRAINER: 1})
    state = client.submit(with_optim, state, cfg.optim, key=f"replay-optim{tag}")
    published = client.submit(weights_of, state, key=f"replay-weights-init{tag}")
    log(f"replaying {len(steps)} committed steps of {reader.path} from {init}")
    for step in steps:
        futures = submit_replayed_step(client, reader, step, cfg, state, published, tag)
        if futures is None:
            continue
        trained = futures.update.result()
        m = trained.metrics
        results = client.gather(futures.executions)
        report.add_step({"step": step, "version": trained.version,
                         "mean_reward": float(np.mean([r.reward for r in results])),
                         "executions": len(results), "elapsed_s": time.time() - t0,
                         "train": {k: m[k] for k in ("trained_tokens", "padded_tokens", "stale_masked", "grad_norm",
                                                     "clip_frac", "approx_kl", "train_s", "share_workers") if k in m}})
        log(f"step {step}: version {trained.version}  trained tokens {m.get('trained_tokens', 0)}  "
            f"grad norm {m.get('grad_norm', float('nan')):.3f}")
        state, published = futures.update, futures.published
    final = client.submit(save_state, state, str(out_dir / "checkpoints" / "final"), steps[-1] if steps else -1,
                          key=f"replay-checkpoint{tag}", resources={TRAINER: 1}).result()
    tokens = sum(s["train"].get("trained_tokens", 0) for s in report.data["steps"])
    wall = time.time() - t0
    report.set(completed=True, total_wall_s=wall, trained_tokens=tokens,
               trained_tokens_per_s=tokens / wall if wall > 0 else None, final=final,
               staleness=placement_mode(cfg.cluster.placement).staleness(cfg.rl.staleness))
    if evaluate:
        ev = evaluate_policy(client, cfg, published)
        report.set(heldout_pass_rate=ev["pass_rate"], heldout_mean_reward=ev["mean_reward"],
                   heldout_end_reasons=ev["end_reasons"])
        log(f"held-out pass rate of the replayed policy: {ev['pass_rate']:.3f} (mean reward {ev['mean_reward']:.3f})")
    return report.data


def evaluate_policy(client: Client, cfg: RunConfig, published: Future) -> dict:
    """The held-out tasks of ``cfg`` run by the weights ``published``, on the rollout cells."""
    from gyreflow.agents.sources import task_source
    from gyreflow.cluster.local import cells_of, install
    from gyreflow.cluster.pools import ROLLOUT
    from gyreflow.recipes.common import engine_options
    from gyreflow.recipes.common import evaluate as held_out
    from gyreflow.stepgraph import publish

    install(client, cfg.cluster.torch_threads, engine_options(cfg), "async", {})
    version = published.result().version
    rollout = cells_of(client)[ROLLOUT]
    if not rollout:
        raise ValueError("evaluating the replayed policy needs a rollout cell; the cluster has none")
    publish(client, STAGES, published, rollout, version)
    source = task_source(cfg)
    return held_out(client, source.heldout(), source, cfg, version, None, 0).summary(client)
