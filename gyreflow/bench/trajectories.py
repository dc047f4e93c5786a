"""`gyreflow bench trajectories`: what tree training and bounded path sampling cost, in one run.

Both measurements use the default policy (``ModelConfig()``) on one thread and synthetic branching
executions built from call records (no engine): every execution is a main chain that branches
``branches`` times from a shared prefix (retries, compaction, sub-agents on one prompt all give
this shape), the prefix being ``shared`` of each path's tokens.

tree_training_speedup
    Forward and backward of the executions' paths trained one by one, against the same paths packed
    as one tree per execution (each node forwarded once): time per-path / time tree.
jmax_fwd_bwd_fraction
    Forward and backward time (the default, tree training) with ``j_max`` 1 and 5, over uncapped,
    on executions of at least 10 paths.

stored_tokens_ratio, archive_write_vs_numpy, archive_read_vs_numpy
    Agent executions as they come (prompts extending earlier calls, with compaction, retries and
    sub-agents; :func:`agent_execution`): the tokens their calls hold over the tokens their trees
    store, and the archive's write and read time against ``numpy.save``/``load`` of the calls'
    arrays (``archive.*_vs_numpy_stored``: against numpy of the archive's own arrays, zarr's and the
    tree's overhead alone).

grad_reduce_peak_memory_ratio
    Peak memory of a step's gradient reduction at 32 groups x 8 shares, every share's gradient
    gathered by the update (before) over per-cell running sums on 2 cells (after); see
    :func:`grad_reduce_memory`. Deterministic, so measured once.

Each timing is repeated, the arms interleaved; the JSON gives mean, min and max.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from gyreflow.bench.report import git_revision, spread
from gyreflow.model.policy import ModelConfig, build_policy
from gyreflow.train.packing import PathSample
from gyreflow.train.trainer import OptimConfig, Trainer
from gyreflow.trajectory.records import CallRecord, ExecutionResult
from gyreflow.trajectory.tree import TrajectoryTree, build_tree


def branching_execution(rng: np.random.Generator, execution_id: str, path_tokens: int, shared: float,
                        branches: int) -> ExecutionResult:
    """An execution whose ``branches`` paths share their first ``shared`` fraction of tokens."""
    prefix = int(path_tokens * shared)
    head_prompt = rng.integers(0, 256, prefix // 2).astype(np.int32)
    head = CallRecord(execution_id, 0, f"{execution_id}/0", "main", head_prompt,
                      rng.integers(0, 256, prefix - prefix // 2).astype(np.int32),
                      np.full(prefix - prefix // 2, -1.0, np.float32), np.zeros(prefix - prefix // 2, np.int32))
    context = np.concatenate([head.prompt_ids, head.completion_ids])
    calls = [head]
    for b in range(branches):
        n = path_tokens - prefix
        tail = rng.integers(0, 256, n).astype(np.int32)
        tail[0] = b  # distinct first tokens: each call branches off the shared prefix
        calls.append(CallRecord(execution_id, b + 1, f"{execution_id}/{b + 1}", "main",
                                np.concatenate([context, tail[: n // 4]]), tail[n // 4:],
                                np.full(n - n // 4, -1.0, np.float32), np.zeros(n - n // 4, np.int32)))
    return ExecutionResult(execution_id, "bench", 0, 0, "train", calls, 1.0, True, "done")


def agent_execution(rng: np.random.Generator, execution_id: str, calls: int = 40, task_tokens: int = 400,
                    completion_tokens: int = 80, tool_tokens: int = 160, compact_every: int = 15,
                    retry_every: int = 10, subagent_every: int = 20) -> ExecutionResult:
    """An agent's calls as they come: each prompt is the previous call's prompt, completion and a
    tool reply; every ``compact_every`` calls the context restarts from the task and the latest
    reply (compaction); every ``retry_every`` calls one is retried on the same prompt; every
    ``subagent_every`` calls a sub-agent runs three calls from the task and its own instructions."""
    task = rng.integers(0, 150_000, task_tokens).astype(np.int32)
    out: list[CallRecord] = []

    def call(prompt: np.ndarray, role: str = "main") -> np.ndarray:
        n = int(rng.integers(completion_tokens // 2, completion_tokens * 3 // 2 + 1))
        i = len(out)
        out.append(CallRecord(execution_id, i, f"{execution_id}/{i}", role, prompt,
                              rng.integers(0, 150_000, n).astype(np.int32),
                              -rng.exponential(1.0, n).astype(np.float32), np.zeros(n, np.int32)))
        return np.concatenate([prompt, out[-1].completion_ids])

    def reply() -> np.ndarray:
        return rng.integers(0, 150_000, int(rng.integers(tool_tokens // 2, tool_tokens * 3 // 2 + 1))).astype(np.int32)

    context = task
    for k in range(1, calls + 1):
        seq = call(context)
        if k % retry_every == 0:
            call(context)  # the same prompt again: the first attempt's reply was refused
        if k % subagent_every == 0:
            sub = np.concatenate([task, reply()])
            for _ in range(3):
                sub = np.concatenate([call(sub, "sub-agent"), reply()])
        context = np.concatenate([seq, reply()])
        if k % compact_every == 0:
            context = np.concatenate([task, reply()])
    return ExecutionResult(execution_id, "bench", 0, 0, "train", out, 1.0, True, "done")


def call_arrays(r: ExecutionResult) -> dict[str, np.ndarray]:
    """An execution's calls as one would save them without the tree: every call's prompt and
    completion concatenated (with ``n + 1`` offsets), log-probs and versions."""
    out = {}
    for name, attr in (("prompt", "prompt_ids"), ("completion", "completion_ids")):
        parts = [getattr(c, attr) for c in r.calls]
        out[f"{name}_tokens"] = np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)
        out[f"{name}_offsets"] = np.concatenate([[0], np.cumsum([len(a) for a in parts])]).astype(np.int64)
    out["logprobs"] = np.concatenate([c.logprobs for c in r.calls]) if r.calls else np.zeros(0, np.float32)
    out["versions"] = np.concatenate([c.versions for c in r.calls]) if r.calls else np.zeros(0, np.int32)
    return out


def archive_io(executions: list[ExecutionResult], repeats: int, group: int = 8) -> dict:
    """Stored tokens, and archive write/read time against ``numpy.save``/``load`` of the same calls
    (:func:`call_arrays`: what one would save without the tree) and of the archive's own arrays
    (so only the format's overhead differs); interleaved.

    The archive is written as the pipeline writes it: one segment per group of ``group``
    executions, from the trajectory trees its tree stage built for training (built here before the
    clock starts; ``tree_build`` times them, and ``archive_write_building_trees`` is a write that
    builds them itself, as for executions that are not trained)."""
    import shutil
    import tempfile

    from gyreflow.storage import ArchiveReader, commit_step, create_archive, write_executions
    from gyreflow.storage.writer import execution_arrays

    flat = [call_arrays(r) for r in executions]
    stored = [{n: a for n, a in execution_arrays(r).items() if n != "call_meta"} for r in executions]
    logical = sum(len(c.prompt_ids) + len(c.completion_ids) for r in executions for c in r.calls)
    tree_tokens = sum(len(a["tokens"]) for a in stored)
    trees = [build_tree(r) for r in executions]
    runs: dict[str, list[float]] = {k: [] for k in ("archive_write", "archive_read", "numpy_write", "numpy_read",
                                                     "stored_write", "stored_read", "tree_build",
                                                     "archive_write_building_trees")}
    scratch = Path(tempfile.mkdtemp(prefix="gyreflow-trajectories-"))
    try:
        for i in range(repeats):
            base = scratch / f"round{i}"

            def write_archive(arch: Path, given: list | None) -> None:
                create_archive(arch, {"benchmark": "trajectories"})
                for k in range(0, len(executions), group):
                    write_executions(arch, executions[k : k + group], f"group-{k // group}",
                                     None if given is None else given[k : k + group])
                commit_step(arch, 0)

            def read_archive() -> None:
                reader = ArchiveReader(base / "archive.zarr")
                for eid in reader.executions(0):
                    reader.load_execution(0, eid)

            def numpy_arm(label: str, arrays: list[dict]) -> None:
                d = base / label
                d.mkdir(parents=True)

                def write_numpy() -> None:
                    for r, a in zip(executions, arrays):
                        for name, v in a.items():
                            np.save(d / f"{r.execution_id}.{name}.npy", v)

                def read_numpy() -> None:
                    for r, a in zip(executions, arrays):
                        for name in a:
                            np.load(d / f"{r.execution_id}.{name}.npy")

                runs[f"{label}_write"].append(_timed(write_numpy))
                runs[f"{label}_read"].append(_timed(read_numpy))

            def archive_arm() -> None:
                runs["archive_write"].append(_timed(lambda: write_archive(base / "archive.zarr", trees)))
                runs["archive_read"].append(_timed(read_archive))

            # An arm pays for the write-back of those before it: the order turns every round.
            arms = [lambda: numpy_arm("numpy", flat), lambda: numpy_arm("stored", stored), archive_arm]
            for arm in arms[i % 3:] + arms[: i % 3]:
                arm()
            runs["archive_write_building_trees"].append(_timed(lambda: write_archive(base / "built.zarr", None)))
            runs["tree_build"].append(_timed(lambda: [build_tree(r) for r in executions]))
            shutil.rmtree(base)  # deleted before it is written back: no round leaves the next one disk work
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

    def ratio(base: str, arm: str) -> dict:
        return spread([b / a for a, b in zip(runs[arm], runs[base])], runs=True)

    return {
        "executions": len(executions), "executions_per_segment": group, "calls": sum(len(r.calls) for r in executions),
        "call_tokens": int(logical), "stored_tokens": int(tree_tokens),
        "stored_tokens_ratio": logical / tree_tokens,
        "seconds": {k: spread(v, runs=True) for k, v in runs.items()},
        "archive_write_vs_numpy": ratio("numpy_write", "archive_write"),
        "archive_read_vs_numpy": ratio("numpy_read", "archive_read"),
        "archive_write_building_trees_vs_numpy": ratio("numpy_write", "archive_write_building_trees"),
        "archive_write_vs_numpy_stored": ratio("stored_write", "archive_write"),
        "archive_read_vs_numpy_stored": ratio("stored_read", "archive_read"),
    }


def grad_reduce_memory(groups: int = 32, shares: int = 8, cells: int = 2) -> dict:
    """Peak memory (``tracemalloc``, numpy's allocations included) of reducing one step's gradient
    shares of the default policy, before and after per-cell reduction, in one process.

    Before: the update receives every share with its gradient (as Dask hands a task its
    dependencies) and sums them. After: each share is added into its cell's running sum as it is
    computed and dropped; the update takes one sum per cell and sums those. The gradient values do
    not matter to memory; each share's is the policy's parameter shapes filled with noise.
    """
    import gc
    import tracemalloc

    from gyreflow.train.reduce import CellSums, GradientShare, merge

    shapes = {n: tuple(p.shape) for n, p in build_policy(ModelConfig(), seed=0).named_parameters()}
    param_bytes = 4 * sum(int(np.prod(s)) for s in shapes.values())
    rng = np.random.default_rng(0)

    def share() -> GradientShare:
        return GradientShare({n: rng.standard_normal(s, dtype=np.float32) for n, s in shapes.items()},
                             100, 100.0, {"loss": 1.0}, 0, 0, 0, version=1)

    def peak(fn) -> int:
        gc.collect()
        tracemalloc.start()
        try:
            fn()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    def before() -> None:
        received = [share() for _ in range(groups * shares)]
        merge(received)

    def after() -> None:
        sums = [CellSums() for _ in range(cells)]
        for k in range(groups * shares):
            sums[k % cells].add("bench", f"grad-{k}", share())
        merge([s.take("bench", 1, [f"grad-{k}" for k in range(c, groups * shares, cells)]) for c, s in enumerate(sums)])

    b, a = peak(before), peak(after)
    return {"groups": groups, "shares": shares, "cells": cells, "parameter_bytes": param_bytes,
            "before_peak_bytes": b, "after_peak_bytes": a, "grad_reduce_peak_memory_ratio": b / a}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _fwd_bwd_s(trainer: Trainer, samples: list[PathSample]) -> float:
    t0 = time.perf_counter()
    trainer.gradients(samples, "ppo_clip", clip_eps=0.2)
    return time.perf_counter() - t0


def _samples(trees: list[TrajectoryTree], j_max: int, packed: bool) -> list[PathSample]:
    out = []
    for i, t in enumerate(trees):
        leaves = t.sample_paths(j_max, seed=i)
        if packed and len(leaves) > 1:
            out.append(PathSample.of_tree(t, leaves, 1.0))
        else:
            out += [PathSample.of(p, 1.0) for p in t.paths(leaves)]
    return out


def run(executions: int = 4, path_tokens: int = 640, shared: float = 0.8, branches: int = 8, jmax_paths: int = 12,
        repeats: int = 5, seed: int = 0, archive_executions: int = 32, archive_calls: int = 40,
        reduce_groups: int = 32, reduce_shares: int = 8) -> dict:
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    trainer = Trainer(build_policy(ModelConfig(), seed=seed), OptimConfig(micro_batch_tokens=1 << 30))
    trees = [build_tree(branching_execution(rng, f"e{i}", path_tokens, shared, branches)) for i in range(executions)]
    per_path, tree_packed = _samples(trees, 0, packed=False), _samples(trees, 0, packed=True)
    _fwd_bwd_s(trainer, per_path)  # warm-up: both arms' buffers allocated before timing
    _fwd_bwd_s(trainer, tree_packed)
    t_path, t_tree = [], []
    for _ in range(repeats):
        t_path.append(_fwd_bwd_s(trainer, per_path))
        t_tree.append(_fwd_bwd_s(trainer, tree_packed))
    wide = [build_tree(branching_execution(rng, f"w{i}", path_tokens, shared, jmax_paths)) for i in range(executions)]
    assert all(t.n_leaves >= 10 for t in wide)
    t_j: dict[int, list[float]] = {0: [], 1: [], 5: []}
    for _ in range(repeats):
        for j in t_j:
            t_j[j].append(_fwd_bwd_s(trainer, _samples(wide, j, packed=True)))
    speedup = [a / b for a, b in zip(t_path, t_tree)]
    reduce_mem = grad_reduce_memory(reduce_groups, reduce_shares)
    archive = archive_io([agent_execution(rng, f"a{i}", calls=archive_calls) for i in range(archive_executions)],
                         repeats)
    fraction = {str(j): spread([a / b for a, b in zip(t_j[j], t_j[0])], runs=True) for j in (1, 5)}
    return {
        "git": git_revision(),
        "options": {"executions": executions, "path_tokens": path_tokens, "shared": shared, "branches": branches,
                    "jmax_paths": jmax_paths, "repeats": repeats, "model": ModelConfig().asdict(), "threads": 1},
        "tokens_forwarded": {"per_path": int(sum(len(s.tokens) for s in per_path)),
                             "tree": int(sum(len(s.tokens) for s in tree_packed))},
        "per_path_s": spread(t_path, runs=True), "tree_s": spread(t_tree, runs=True),
        "tree_training_speedup": spread(speedup, runs=True),
        "jmax_fwd_bwd_s": {str(j): spread(v, runs=True) for j, v in t_j.items()},
        "jmax_fwd_bwd_fraction": fraction,
        "archive": archive,
        "stored_tokens_ratio": archive["stored_tokens_ratio"],
        "archive_write_vs_numpy": archive["archive_write_vs_numpy"],
        "archive_read_vs_numpy": archive["archive_read_vs_numpy"],
        "grad_reduce": reduce_mem,
        "grad_reduce_peak_memory_ratio": reduce_mem["grad_reduce_peak_memory_ratio"],
    }


def summary(out: dict) -> str:
    s, f = out["tree_training_speedup"], out["jmax_fwd_bwd_fraction"]
    tok = out["tokens_forwarded"]
    return "\n".join([
        f"tree training: per-path {out['per_path_s']['mean']:.2f} s, tree {out['tree_s']['mean']:.2f} s "
        f"({tok['per_path']:,} vs {tok['tree']:,} tokens forwarded)",
        f"tree_training_speedup: {s['mean']:.2f}x (min {s['min']:.2f}, max {s['max']:.2f})",
        *(f"jmax_fwd_bwd_fraction[{j}]: {f[j]['mean']:.3f} (min {f[j]['min']:.3f}, max {f[j]['max']:.3f})"
          for j in ("1", "5")),
        f"stored_tokens_ratio: {out['stored_tokens_ratio']:.2f}x fewer tokens as trees "
        f"({out['archive']['call_tokens']:,} in the calls, {out['archive']['stored_tokens']:,} stored)",
        *(f"archive_{ph}_vs_numpy: {out[f'archive_{ph}_vs_numpy']['mean']:.2f} "
          f"(min {out[f'archive_{ph}_vs_numpy']['min']:.2f}, max {out[f'archive_{ph}_vs_numpy']['max']:.2f}); "
          f"vs numpy of the stored arrays {out['archive'][f'archive_{ph}_vs_numpy_stored']['mean']:.3f}"
          for ph in ("write", "read")),
        f"  the write from the trees built for training; building them in the write: "
        f"{out['archive']['archive_write_building_trees_vs_numpy']['mean']:.2f} "
        f"(building {out['archive']['calls']:,} calls' trees: {out['archive']['seconds']['tree_build']['mean'] * 1e3:.0f} ms)",
        f"grad_reduce_peak_memory_ratio: {out['grad_reduce_peak_memory_ratio']:.1f}x less at "
        f"{out['grad_reduce']['groups']} groups x {out['grad_reduce']['shares']} shares on "
        f"{out['grad_reduce']['cells']} cells ({out['grad_reduce']['before_peak_bytes'] / 1e6:,.0f} MB before, "
        f"{out['grad_reduce']['after_peak_bytes'] / 1e6:,.0f} MB after; parameters "
        f"{out['grad_reduce']['parameter_bytes'] / 1e6:,.0f} MB)",
    ])


def write_json(out: dict, path: str) -> None:
    Path(path).write_text(json.dumps(out, indent=2))
