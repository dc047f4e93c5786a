"""The pipeline's stages: plain functions that run as Dask tasks on the cells of their pool.

Long-lived state (the engine, the trainer) stays in its worker plugin; these functions bring it
data and references, never models. The recipes (``gyreflow.recipes``) submit them with readable keys.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import asdict
from itertools import zip_longest
from pathlib import Path

import numpy as np
import torch
from distributed import get_worker
from distributed.utils import sync

from gyreflow.agents.external import ExternalAgent, run_external
from gyreflow.agents.loop import AgentConfig, run_agent
from gyreflow.agents.suite import SuiteTask
from gyreflow.agents.sources import task_source
from gyreflow.agents.tasks import Task
from gyreflow.algo import ADVANTAGES, AGGREGATIONS, GroupTree
from gyreflow.cluster.router import Router
from gyreflow.engine.service import PLUGIN_NAME as ENGINE_PLUGIN
from gyreflow.proxy.plugin import PLUGIN_NAME as PROXY_PLUGIN
from gyreflow.train.packing import PathSample, probe_of
from gyreflow.train.service import PLUGIN_NAME as TRAINER_PLUGIN
from gyreflow.train.reduce import GradientShare, msg_to_share
from gyreflow.train.state import GroupSamples, PolicyState, PublishedWeights
from gyreflow.storage import ArchiveReader
from gyreflow.storage.reader import load_from_segment
from gyreflow.storage.writer import tokens_digest, write_executions
from gyreflow.trajectory.records import ExecutionResult, record_problems
from gyreflow.trajectory.group import group_tree
from gyreflow.trajectory.tree import TrajectoryTree, build_tree

logger = logging.getLogger("gyreflow")

# The model code (transformers: seconds of CPU to import) is imported inside the stages that build
# a model, so that the driver, which only names these stages, never loads it.


def _published(model, version: int, optim, run: str) -> PublishedWeights:
    from gyreflow.model.policy import state_dict_numpy

    return PublishedWeights(version, run, model.config.to_dict(), state_dict_numpy(model), optim)


def sft_fingerprint(cfg) -> str:
    """Identifies an SFT result: same model, task and SFT settings give the same checkpoint."""
    key = json.dumps({"model": asdict(cfg.model), "task": asdict(cfg.task), "sft": asdict(cfg.sft),
                      "agent": asdict(cfg.agent), "seed": cfg.rl.seed,
                      **({"external": asdict(cfg.external)} if cfg.task.suite else {})}, sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def sft_warm_start(cfg, checkpoint_dir: str, cache_dir: str | None = None, run: str = "run") -> PolicyState:
    """Train the SFT policy on synthetic demonstrations (or reuse a cached one), save it as a
    checkpoint, and return it as the RL state of version 0 (fresh optimizer). Runs on a trainer
    cell."""
    from gyreflow.model.policy import build_policy, load_policy, save_policy
    from gyreflow.train.trainer import Trainer

    service = get_worker().plugins[TRAINER_PLUGIN]
    t0 = time.time()
    cached = Path(cache_dir, sft_fingerprint(cfg)) if cache_dir else None
    metrics: dict = {}
    if cached is not None and (cached / "config.json").is_file():
        model = load_policy(cached)
        metrics["cached"] = str(cached)
    else:
        model = build_policy(cfg.model, seed=cfg.rl.seed)
        demos = task_source(cfg).demonstrations()
        samples = [PathSample.of(p, 0.0) for d in demos for p in build_tree(d).paths()]
        trainer = Trainer(model, cfg.optim)
        rng = np.random.default_rng(cfg.rl.seed)
        threads = torch.get_num_threads()
        # Nothing else runs during the warm start, so it may use every core of the cell.
        torch.set_num_threads(max(threads, len(os.sched_getaffinity(0))))
        try:
            for k in range(cfg.sft.steps):
                for g in trainer.optimizer.param_groups:
                    g["lr"] = cfg.sft.lr * min(1.0, (k + 1) / 30)
                out = trainer.sft_step([samples[j] for j in rng.integers(0, len(samples), cfg.sft.batch_size)])
        finally:
            torch.set_num_threads(threads)
        metrics.update(nll=out["nll"] if cfg.sft.steps else None, demos=len(demos),
                       demo_pass_rate=float(np.mean([d.passed for d in demos])))
        if cached is not None:
            save_policy(model, cached)
    save_policy(model, checkpoint_dir)
    metrics["sft_s"] = time.time() - t0
    with service.lock:
        service.at(published := _published(model, 0, cfg.optim, run))
    return PolicyState(published, None, metrics)


def publish_weights(published: PublishedWeights) -> dict:
    """Install a weights version in this rollout cell's engine. Runs on a rollout cell."""
    service = get_worker().plugins[ENGINE_PLUGIN]
    return service.load(published.hf_config, published.weights, published.version)


def run_native_execution(task: Task, agent: AgentConfig, execution_id: str, step: int, sample: int, seed: int,
                         router: Router) -> ExecutionResult:
    """The native agent loop, calling the engines through the router."""
    return run_agent(task, router, agent, execution_id, step=step, sample=sample, seed=seed)


def run_external_execution(task: SuiteTask, agent: ExternalAgent, execution_id: str, step: int, sample: int,
                           seed: int, router: Router) -> ExecutionResult:
    """An agent program as a subprocess, its calls through this worker's proxy and the router."""
    proxy = get_worker().plugins[PROXY_PLUGIN]
    return run_external(task, agent, proxy, router.agenerate, execution_id, step=step, sample=sample, seed=seed)


EXECUTORS = {"vault": run_native_execution, "suite": run_external_execution}
"""How an execution of each kind of task runs (the only dispatch on task kind)."""


def run_execution(task, agent, execution_id: str, step: int, sample: int, seed: int,
                  retries: int = 2) -> ExecutionResult:
    """One execution of ``task``: the native agent for vault tasks, an agent program for suite
    tasks; its model calls go through the router. Runs in an execution slot.

    Never raises: an execution the system fails (``infra_failure``, ``grader_failure``, or any
    error of the executor itself) is re-run up to ``retries`` times, each attempt as a new session,
    then returned as a zero-reward placeholder (:attr:`ExecutionResult.dropped`) with the last
    attempt's error."""
    for attempt in range(retries + 1):
        session = execution_id if attempt == 0 else f"{execution_id}.retry{attempt}"
        router = Router(session=session)
        try:
            result = EXECUTORS[task.kind](task, agent, session, step, sample, seed, router)
        except Exception as err:
            result = ExecutionResult(session, task.task_id, step, sample, task.split, [], 0.0, False, "infra_failure",
                                     {"error": f"{type(err).__name__}: {err}"})
        finally:
            try:
                router.close()
            except Exception:  # the scheduler forgets the session when this worker goes
                logger.warning("gyreflow: session %s could not be released", session, exc_info=True)
        if not result.dropped:
            break
    result.metrics["attempts"] = attempt + 1
    if result.dropped:
        result = ExecutionResult(execution_id, task.task_id, step, sample, task.split, [], 0.0, False,
                                 result.end_reason, result.metrics)
    result.execution_id = execution_id
    for call in result.calls:
        call.execution_id = execution_id
    result.worker = get_worker().address
    return result


def make_tree(result: ExecutionResult, vocab_size: int | None = None,
              max_positions: int | None = None) -> TrajectoryTree:
    """The execution's calls merged into a prefix-sharing tree. Records that contradict each other
    (:func:`~gyreflow.trajectory.records.record_problems`) are reported with the execution id and
    left out: the tree is a dropped placeholder."""
    problems = record_problems(result, vocab_size, max_positions)
    if problems:
        logger.warning("execution %s excluded from training: %s", result.execution_id, "; ".join(problems))
        return build_tree(ExecutionResult(result.execution_id, result.task_id, result.step, result.sample,
                                          result.split, [], 0.0, False, "infra_failure",
                                          {"invalid_records": problems}))
    return build_tree(result)


_READERS: OrderedDict[str, ArchiveReader] = OrderedDict()
_READERS_LOCK = threading.Lock()


def archived_execution(archive: str, step: int, execution_id: str) -> ExecutionResult:
    """An execution read back from the archive, token-exact (a replay's stand-in for running it).
    Readers are kept per process, so a segment is decoded once for all its executions."""
    with _READERS_LOCK:
        reader = _READERS.get(archive)
        if reader is None:
            reader = _READERS[archive] = ArchiveReader(archive)
            while len(_READERS) > 4:
                _READERS.popitem(last=False)
        elif step not in reader.committed_steps:
            reader.refresh()  # committed since this process first read it
        return reader.load_execution(step, execution_id)


def archive_group(archive: str, results: list[ExecutionResult], segment: str,
                  trees: list[TrajectoryTree]) -> list[dict]:
    """Write a group's executions into the archive as one segment; a segment already complete is
    kept (the first write wins: see :func:`archived_trees`). Runs in an execution slot."""
    return write_executions(archive, results, segment, trees, keep_existing=True)


def archived_trees(trees: list[TrajectoryTree], written: list[dict], archive: str, segment: str,
                   vocab_size: int | None = None, max_positions: int | None = None) -> list[TrajectoryTree]:
    """The group's trees as its archive segment holds them. When a worker dies, Dask runs lost
    executions again; a re-run that differs from what was archived is replaced by the archived
    execution, so a step trains exactly what its archive holds. Runs in an execution slot."""
    digests = {w["execution_id"]: w.get("digest") for w in written}
    out = []
    for t in trees:
        if digests.get(t.execution_id) in (None, tokens_digest(t.tokens)):
            out.append(t)
            continue
        step = next(int(w["step"]) for w in written if w["execution_id"] == t.execution_id)
        logger.warning("execution %s ran again after its worker died; training the archived run", t.execution_id)
        out.append(make_tree(load_from_segment(archive, step, segment, t.execution_id), vocab_size, max_positions))
    return out


def group_advantages(trees: list[TrajectoryTree], estimator: str, j_max: int = 0,
                     aggregation: str = "execution_mean", seed: int = 0, tree_training: bool = False) -> GroupSamples:
    """Advantages of one group (the executions of one task), and the paths it trains: at most
    ``j_max`` per execution by role priority, each sample weighted by ``aggregation``; with
    ``tree_training``, an execution's paths are one tree-shaped sample (shared nodes forwarded once)."""
    rewards = np.array([t.reward for t in trees], dtype=np.float64)  # (G,)
    kept = np.array([not t.dropped for t in trees], dtype=np.bool_)  # (G,)
    # Placeholders of executions the system failed are no verdict on the policy: the advantages
    # are those of the group without them, and they train nothing.
    token_adv = [np.zeros(t.unique_tokens) for t in trees]  # (U_g,) per execution
    if kept.any():
        fn, judged = ADVANTAGES.get(estimator), [t for t, k in zip(trees, kept) if k]
        if getattr(fn, "node_level", False):
            group, token_nodes = group_tree(judged)
        else:  # one advantage per execution: one node each is enough
            group = GroupTree.flat(rewards[kept])
            token_nodes = [np.full(t.unique_tokens, j) for j, t in enumerate(judged)]
        node_adv = fn(group)  # (K, G_kept)
        for j, g in enumerate(np.flatnonzero(kept)):
            token_adv[g] = node_adv[token_nodes[j], j]
    # Reported per execution: the mean over its sampled tokens (its one advantage, for the
    # group-relative estimators).
    adv = np.array([a[t.sampled].mean() if t.sampled.any() else 0.0 for t, a in zip(trees, token_adv)])  # (G,)
    if not any(a.any() for a in token_adv):
        # No signal (every reward alike): nothing to learn, and a forward and backward saved;
        # left out of the step, it does not dilute the others either.
        return GroupSamples([], rewards.tolist(), adv.tolist())
    leaves = [t.sample_paths(j_max, path_seed(seed, t.execution_id)) if k else [] for t, k in zip(trees, kept)]
    paths = [t.paths(ls) for t, ls in zip(trees, leaves)]
    weight = AGGREGATIONS.get(aggregation)(np.array([sum(p.n_trained for p in ps) for ps in paths]))  # (G,)
    samples = []
    for t, ls, ps, a, w in zip(trees, leaves, paths, token_adv, weight):
        one = len(a) > 0 and bool(np.all(a == a[0]))  # one advantage for every token: pass it as a number
        if tree_training and len(ps) > 1:
            samples.append(PathSample.of_tree(t, ls, a[0] if one else a, w))
        else:
            samples += [PathSample.of(p, a[0] if one else a[t.token_index(p.nodes)], w) for p in ps]
    return GroupSamples(samples, rewards.tolist(), adv.tolist())


def path_seed(seed: int, execution_id: str) -> int:
    """Seed of an execution's path sampling: the run's seed and the execution, nothing else."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{execution_id}".encode(), digest_size=8).digest(), "little")


def weights_of(state: PolicyState) -> PublishedWeights:
    """The published weights of an RL state, without the optimizer state (what engines and
    gradient shares need)."""
    return state.published


def partition(sizes: list[int], parts: int) -> list[list[int]]:
    """Indices of ``sizes`` cut into ``parts`` token-balanced bins (longest first into the lightest
    bin; deterministic)."""
    bins: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        b = min(range(parts), key=lambda b: (load[b], b))
        bins[b].append(i)
        load[b] += sizes[i]
    return bins


def gradient_share(group: GroupSamples, published: PublishedWeights, j: int, shares: int, loss: str, loss_kwargs: dict,
                   max_staleness: int | None = None, is_cap: float = 0.0, probe_tokens: int = 0) -> GradientShare:
    """The gradient of the ``j``-th of ``shares`` parts of one group's paths at the ``published``
    weights: one share of a step's gradient work, with up to ``probe_tokens`` tokens of its
    samples for the update to measure itself on. Runs on any trainer cell, so a cell that joins
    mid-step takes shares too."""
    worker = get_worker()
    service = worker.plugins[TRAINER_PLUGIN]
    trainable = [s for s in group.samples if s.n_trained]
    samples = [trainable[i] for i in partition([s.n_trained for s in trainable], shares)[j]]
    with service.lock:
        trainer = service.at(published)
        t0 = time.time()
        out = trainer.gradients(samples, loss, max_staleness, is_cap, **loss_kwargs)
        out.train_s = time.time() - t0
    out.worker = worker.address
    out.probe = probe_of(samples, probe_tokens)
    # The gradient stays on this cell, in its running sum for the step; the update takes the sum.
    return service.sums.add(published.run, worker.get_current_task(), out)


class LostGradients(RuntimeError):
    """A cell that held gradient shares of the step could not hand them over."""


def gather_sums(shares: list[GradientShare], run: str) -> list[GradientShare]:
    """One summed share per cell that holds some of ``shares`` (their gradients), taken from the
    cells' running sums: this cell's directly, the others' by RPC. Runs inside a task."""
    worker = get_worker()
    service = worker.plugins[TRAINER_PLUGIN]
    by_cell: dict[str, list[GradientShare]] = {}
    for s in shares:
        by_cell.setdefault(s.worker, []).append(s)
    keys = {cell: sorted(s.key for s in held) for cell, held in by_cell.items()}
    out = []
    for cell, held in by_cell.items():
        version = held[0].version
        try:
            if cell == worker.address:
                out.append(service.sums.take(run, version, keys[cell]))
                continue
            msg = sync(worker.loop, worker.rpc(cell).gyreflow_grad_take, run=run, version=version, keys=keys[cell])
        except (KeyError, OSError) as err:
            raise LostGradients(f"cell {cell} could not hand over its gradient sum: {err}") from None
        if "error" in msg:
            raise LostGradients(f"cell {cell} could not hand over its gradient sum: {msg['error']}")
        out.append(msg_to_share(msg))
    return out


def apply_update(step: int, shares: list[GradientShare], state: PolicyState, max_kl: float = 0.0,
                 probe_tokens: int = 0) -> PolicyState:
    """The step's optimizer update from its gradient shares (one summed gradient taken from each
    cell that computed some); the next RL state (new weights version, optimizer state). With
    ``max_kl``, the update moves the policy at most that far on a probe of ``probe_tokens`` tokens
    taken from every share in turn. Runs on a trainer cell."""
    service = get_worker().plugins[TRAINER_PLUGIN]
    # One sample from each share in turn, so the probe covers the step's groups.
    probe = probe_of([p for turn in zip_longest(*(s.probe for s in shares)) for p in turn if p is not None],
                     probe_tokens)
    with service.lock:
        trainer = service.resume(state)
        t0 = time.time()
        metrics = trainer.apply_gradients(gather_sums(shares, state.run), max_kl, probe)
        service.applied()
        published = _published(trainer.model, trainer.version, trainer.cfg, state.run)
        # A copy: the state dict holds the optimizer's live tensors, which the cell's next update
        # changes in place while Dask may still hand this state out (a checkpoint, a resume).
        optimizer = copy.deepcopy(trainer.optimizer.state_dict())
    metrics["apply_s"] = time.time() - t0
    metrics["train_s"] = sum(s.train_s for s in shares) + metrics["apply_s"]
    metrics["share_workers"] = sorted({s.worker for s in shares})
    metrics["step"] = step
    return PolicyState(published, optimizer, metrics)


def save_checkpoint(published: PublishedWeights, path: str) -> str:
    """Write a published weights version as a Hugging Face checkpoint directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from gyreflow.model.policy import load_state_dict_numpy, save_policy

    model = LlamaForCausalLM(LlamaConfig(**published.hf_config))
    load_state_dict_numpy(model, published.weights)
    save_policy(model, path)
    return path
