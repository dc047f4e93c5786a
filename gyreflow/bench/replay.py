"""``gyreflow bench replay``: training throughput of a replay against training inside the online
run it replays, on one embedded cluster in one invocation."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gyreflow.bench.report import git_revision


def run_bench(cfg, out: Path, repeats: int = 3, cache_dir: Path | None = None, log=print) -> dict:
    """One online GRPO run, then ``repeats`` replays of its archive with its own config."""
    from distributed import Client

    from gyreflow.cluster.local import PoolSpec, install_trainers, local_cluster
    from gyreflow.recipes import grpo, replay

    spec = PoolSpec(rollout=cfg.cluster.rollout_workers, trainer=cfg.cluster.trainer_workers,
                    execution_slots=cfg.cluster.execution_slots)
    with local_cluster(spec) as cluster, Client(cluster) as client:
        log(f"online run: {cfg.rl.steps} steps ...")
        online = grpo.run(client, cfg, out / "online", log=lambda *_: None, cache_dir=cache_dir)
        # Replays only train: cells stay where they are, whatever the run's placement would do.
        client.sync(client.scheduler.gyreflow_placement, mode="async", options={})
        install_trainers(client, cfg.cluster.torch_threads)
        runs = []
        for i in range(repeats):
            r = replay.run(client, cfg, out / "online", out / f"replay-{i}", log=lambda *_: None)
            runs.append(r)
            log(f"replay {i + 1}/{repeats}: {r['trained_tokens']} tokens in {r['total_wall_s']:.1f}s")
    steps = online["steps"]
    tokens = sum(s.get("train", {}).get("trained_tokens", 0) for s in steps)
    rl_wall = sum(s["wall_s"] for s in steps)
    train_s = sum(s.get("train", {}).get("train_s", 0.0) for s in steps)
    rates = np.array([r["trained_tokens"] / r["total_wall_s"] for r in runs])
    online_wall_rate = tokens / rl_wall
    online_train_rate = tokens / train_s if train_s else float("nan")

    def spread(x: np.ndarray) -> dict:
        return {"mean": float(x.mean()), "min": float(x.min()), "max": float(x.max())}

    return {
        "git": git_revision(), "config": cfg.to_json(), "repeats": repeats, "trained_tokens": tokens,
        "online": {"rl_wall_s": rl_wall, "train_s": train_s, "tokens_per_s": online_wall_rate,
                   "tokens_per_train_s": online_train_rate},
        "replay": {"wall_s": [r["total_wall_s"] for r in runs], "tokens_per_s": spread(rates)},
        "ratios": {"replay_vs_online_run": spread(rates / online_wall_rate),
                   "replay_vs_online_training_time": spread(rates / online_train_rate)},
    }


def format_replay(out: dict) -> str:
    o, r, q = out["online"], out["replay"]["tokens_per_s"], out["ratios"]
    return (f"trained tokens (all steps): {out['trained_tokens']}\n"
            f"online run: {o['tokens_per_s']:.0f} trained tokens/s of RL wall time ({o['rl_wall_s']:.1f}s); "
            f"{o['tokens_per_train_s']:.0f}/s of the cells' training time ({o['train_s']:.1f}s)\n"
            f"replay ({out['repeats']}x): {r['mean']:.0f} tokens/s (min {r['min']:.0f}, max {r['max']:.0f})\n"
            f"replay vs the online run: {q['replay_vs_online_run']['mean']:.2f}x "
            f"(min {q['replay_vs_online_run']['min']:.2f}, max {q['replay_vs_online_run']['max']:.2f}); "
            f"vs its training time alone: {q['replay_vs_online_training_time']['mean']:.2f}x")
