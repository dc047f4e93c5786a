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

Each figure is repeated, the two arms interleaved; the JSON gives mean, min and max. Keys the
issue tracker's tools also read but this command does not measure yet (stored tokens, archive
throughput, gradient-reduction memory) are listed under ``not_measured``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

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


def _fwd_bwd_s(trainer: Trainer, samples: list[PathSample]) -> float:
    t0 = time.perf_counter()
    trainer.gradients(samples, "ppo_clip", clip_eps=0.2)
    return time.perf_counter() - t0


def _stats(xs: list[float]) -> dict:
    return {"mean": statistics.fmean(xs), "min": min(xs), "max": max(xs), "runs": xs}


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
        repeats: int = 3, seed: int = 0) -> dict:
    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    trainer = Trainer(build_policy(ModelConfig(), seed=seed), OptimConfig(micro_batch_tokens=1 << 30))
    trees = [build_tree(branching_execution(rng, f"e{i}", path_tokens, shared, branches)) for i in range(executions)]
    per_path, tree_packed = _samples(trees, 0, packed=False), _samples(trees, 0, packed=True)
    _fwd_bwd_s(trainer, tree_packed[:1])  # warm-up
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
    fraction = {str(j): _stats([a / b for a, b in zip(t_j[j], t_j[0])]) for j in (1, 5)}
    return {
        "git": _git(),
        "options": {"executions": executions, "path_tokens": path_tokens, "shared": shared, "branches": branches,
                    "jmax_paths": jmax_paths, "repeats": repeats, "model": ModelConfig().asdict(), "threads": 1},
        "tokens_forwarded": {"per_path": int(sum(len(s.tokens) for s in per_path)),
                             "tree": int(sum(len(s.tokens) for s in tree_packed))},
        "per_path_s": _stats(t_path), "tree_s": _stats(t_tree),
        "tree_training_speedup": _stats(speedup),
        "jmax_fwd_bwd_s": {str(j): _stats(v) for j, v in t_j.items()},
        "jmax_fwd_bwd_fraction": fraction,
        "not_measured": ["stored_tokens_ratio", "archive_write_vs_numpy", "archive_read_vs_numpy",
                         "grad_reduce_peak_memory_ratio"],
    }


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def summary(out: dict) -> str:
    s, f = out["tree_training_speedup"], out["jmax_fwd_bwd_fraction"]
    tok = out["tokens_forwarded"]
    return "\n".join([
        f"tree training: per-path {out['per_path_s']['mean']:.2f} s, tree {out['tree_s']['mean']:.2f} s "
        f"({tok['per_path']:,} vs {tok['tree']:,} tokens forwarded)",
        f"tree_training_speedup: {s['mean']:.2f}x (min {s['min']:.2f}, max {s['max']:.2f})",
        *(f"jmax_fwd_bwd_fraction[{j}]: {f[j]['mean']:.3f} (min {f[j]['min']:.3f}, max {f[j]['max']:.3f})"
          for j in ("1", "5")),
        f"not measured by this command yet: {', '.join(out['not_measured'])}",
    ])


def write_json(out: dict, path: str) -> None:
    Path(path).write_text(json.dumps(out, indent=2))
