"""``gyreflow bench pieces``: one long path's gradient whole vs in pieces (peak memory and time).

Each arm runs in a fresh process (``spawn``), so its peak resident memory is its own: the figure is
the peak over the process's size just before the gradient (the model, torch and the sample loaded).
Arms alternate, their order turned every round.
"""

from __future__ import annotations

import multiprocessing as mp
import resource
import statistics
import time

import numpy as np

from gyreflow.bench.report import git_revision, spread


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _arm(tokens: int, piece: int, model: dict, seed: int) -> dict:
    """One gradient of a ``tokens``-long path with micro-batches of ``piece`` tokens, in this process."""
    import torch

    from gyreflow.model.policy import ModelConfig, build_policy
    from gyreflow.train.packing import PathSample
    from gyreflow.train.trainer import OptimConfig, Trainer

    torch.set_num_threads(1)
    rng = np.random.default_rng(seed)
    trained = rng.random(tokens) < 0.25  # the sampled share of an agent's context
    trained[0] = False
    sample = PathSample(rng.integers(0, 256, tokens).astype(np.int32), trained,
                        np.where(trained, -5.5, 0).astype(np.float32), np.zeros(tokens, np.int32), 1.0)
    trainer = Trainer(build_policy(ModelConfig(**model), seed=seed), OptimConfig(micro_batch_tokens=piece))
    before = _rss_bytes()
    t0 = time.perf_counter()
    share = trainer.gradients([sample], "reinforce")
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    norm = float(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in share.grads.values())))
    return {"seconds": seconds, "peak_bytes": peak - before, "grad_norm": norm}


def _in_process(*args) -> dict:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_arm, args)


def run(tokens: int = 4096, piece: int = 512, repeats: int = 3, model: dict | None = None, seed: int = 0) -> dict:
    from gyreflow.model.policy import ModelConfig

    model = model or ModelConfig().asdict()
    model["max_position_embeddings"] = max(model.get("max_position_embeddings", 0), tokens)
    arms = {"whole": tokens, "pieces": piece}
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(repeats):
        for name in (list(arms) if r % 2 == 0 else list(reversed(arms))):
            runs[name].append(_in_process(tokens, arms[name], model, seed))
    memory = [w["peak_bytes"] / p["peak_bytes"] for w, p in zip(runs["whole"], runs["pieces"])]
    time_ratio = [p["seconds"] / w["seconds"] for w, p in zip(runs["whole"], runs["pieces"])]
    return {
        "git": git_revision(),
        "options": {"tokens": tokens, "piece": piece, "repeats": repeats, "model": model, "threads": 1},
        "whole": runs["whole"], "pieces": runs["pieces"],
        "grad_norm_rel_diff": max(abs(w["grad_norm"] - p["grad_norm"]) / w["grad_norm"]
                                  for w, p in zip(runs["whole"], runs["pieces"])),
        "long_path_peak_memory_ratio": spread(memory, runs=True),
        "long_path_time_ratio": spread(time_ratio, runs=True),
    }


def summary(out: dict) -> str:
    m, t, o = out["long_path_peak_memory_ratio"], out["long_path_time_ratio"], out["options"]
    mb = {a: statistics.fmean(r["peak_bytes"] for r in out[a]) / 1e6 for a in ("whole", "pieces")}
    return "\n".join([
        f"one path of {o['tokens']:,} tokens, whole vs pieces of {o['piece']:,} ({o['repeats']} rounds, 1 thread)",
        f"long_path_peak_memory_ratio: {m['mean']:.2f}x less in pieces (min {m['min']:.2f}, max {m['max']:.2f}; "
        f"{mb['whole']:,.0f} MB whole, {mb['pieces']:,.0f} MB in pieces)",
        f"long_path_time_ratio: {t['mean']:.2f}x the time in pieces (min {t['min']:.2f}, max {t['max']:.2f})",
        f"gradient norms agree within {out['grad_norm_rel_diff']:.1e} (relative)",
    ])
