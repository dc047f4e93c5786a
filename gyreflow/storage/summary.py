"""``gyreflow inspect ARCHIVE``: per committed step, what the archive holds, from the step
indexes alone (no token array is read), and PNG plots of it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gyreflow.storage.reader import ArchiveReader


def step_rows(reader: ArchiveReader) -> list[dict]:
    """One row per committed step: executions (train / held-out), calls, tokens, the dedup ratio
    (prompt + completion tokens over tokens stored once in the trees), train reward and pass
    rate, held-out pass rate, end reasons."""
    rows = []
    for step in reader.committed_steps:
        index = reader.execution_index(step)
        train = [e for e in index.values() if e.get("split") == "train"]
        held = [e for e in index.values() if e.get("split") == "heldout"]
        seen = sum(int(e.get("n_prompt_tokens") or 0) + int(e.get("n_completion_tokens") or 0) for e in index.values())
        stored = sum(int(e.get("n_stored_tokens") or 0) for e in index.values())
        reasons: dict[str, int] = {}
        for e in train:
            reasons[str(e.get("end_reason"))] = reasons.get(str(e.get("end_reason")), 0) + 1
        rows.append({
            "step": step,
            "train_executions": len(train),
            "heldout_executions": len(held),
            "calls": sum(int(e.get("n_calls") or 0) for e in index.values()),
            "tokens": seen,
            "stored_tokens": stored,
            "completion_tokens": sum(int(e.get("n_completion_tokens") or 0) for e in index.values()),
            "dedup_ratio": seen / stored if stored else None,
            "train_reward": _mean([e.get("reward") for e in train]),
            "train_pass_rate": _mean([e.get("passed") for e in train]),
            "heldout_pass_rate": _mean([e.get("passed") for e in held]),
            "end_reasons": reasons,
        })
    return rows


def _mean(values) -> float | None:
    xs = [float(v) for v in values if v is not None]
    return float(np.mean(xs)) if xs else None


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    """``reward.png``, ``pass_rate.png`` and ``tokens.png`` per step into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    figures = {
        "reward.png": ("mean train reward", [("train", [r["train_reward"] for r in rows])]),
        "pass_rate.png": ("pass rate", [("train", [r["train_pass_rate"] for r in rows]),
                                        ("held-out", [r["heldout_pass_rate"] for r in rows])]),
        "tokens.png": ("tokens", [("prompt + completion", [r["tokens"] for r in rows]),
                                  ("stored (deduplicated)", [r["stored_tokens"] for r in rows])]),
    }
    written = []
    for name, (ylabel, series) in figures.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, ys in series:
            pts = [(s, y) for s, y in zip(steps, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=label)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)
        written.append(out_dir / name)
    return written
