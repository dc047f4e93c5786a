"""Benchmark figures: spreads and the git revision for every benchmark's JSON; the placement
benchmark's figures as text (a terminal table, and the README's tables, generated from its JSON,
never typed in)."""

from __future__ import annotations

import re
import statistics
import subprocess
from pathlib import Path

RATIO_LABELS = {
    "elastic_vs_async_user": "elastic vs async (user's split)",
    "elastic_vs_async_oracle": "elastic vs async (best split, oracle)",
    "elastic_vs_colocated": "elastic vs colocated",
    "elastic_vs_lend": "elastic vs lend",
    "elastic_vs_lower_bound": "elastic / lower bound",
    "elastic_vs_batched_bound": "elastic / batching-aware bound",
}


def spread(values: list[float], runs: bool = False) -> dict:
    """``{"mean", "min", "max"}`` of repeated measurements (and the values, with ``runs``)."""
    out = {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}
    return out | {"runs": list(values)} if runs else out


def _pm(s: dict, fmt: str = ",.0f") -> str:
    """``mean (min–max)``."""
    return f"{s['mean']:{fmt}} ({s['min']:{fmt}}–{s['max']:{fmt}})"


def _stretch(m: dict) -> str:
    """The arm's mean stretch of each step's longest execution (JSONs from before it: a dash)."""
    v = m.get("longest_stretch", {}).get("mean")
    return "–" if v is None or v != v else f"{v:.2f}"


def format_placement(out: dict) -> str:
    """The benchmark's figures for a terminal."""
    lines = [f"\nworkload {out['workload']}: {out['repeats']} repeat(s), git {out['git']}",
             f"{'arm':<13} {'split':>6} {'emulated s (min-max)':>30} {'wall s':>8} {'util':>5} {'moves':>6} {'migr':>6} "
             f"{'cpu':>5} {'stretch':>7}"]
    for arm, m in out["modes"].items():
        lines.append(f"{arm:<13} {m['split']:>6} {_pm(m['emulated_s']):>30} {m['wall_s']['mean']:8.1f} "
                     f"{m['utilization']['mean']:5.2f} {m['moves']['mean']:6.0f} {m['migrations']['mean']:6.0f} "
                     f"{m.get('cpu_load', {}).get('max', float('nan')):5.2f} {_stretch(m):>7}")
    if out.get("oracle_splits"):
        tried = ", ".join(f"{k}: {v['mean']:,.0f} s" for k, v in out["oracle_splits"].items())
        lines.append(f"async splits tried (emulated, mean): {tried}; oracle {out['oracle_split']}")
    if out.get("first_step"):
        f = out["first_step"]
        lines.append(f"user's first step: rollout {f['rollout_s']:,.0f} s, training {f['train_s']:,.0f} s")
    lines.append("stretch: each step's longest execution's duration in the run / its duration alone, mean over steps")
    lb = out["lower_bound"]
    lines.append(f"lower bound: {out['lower_bound_s']:,.0f} s emulated (critical path {lb['critical_path_s']:,.0f} s, "
                 f"total work {lb['total_work_s']:,.0f} s); batching-aware bound {out['batched_bound_s']:,.0f} s")
    for k, v in out["ratios"].items():
        lines.append(f"{k}: {v['mean']:.3f}x (min {v['min']:.3f}, max {v['max']:.3f})")
    return "\n".join(lines)


def markdown_tables(outs: list[dict]) -> str:
    """The README's placement tables from benchmark JSONs (one per workload)."""
    lines = ["| workload | arm | split | emulated s, mean (min–max) | wall s | utilization | moves | migrations "
             "| longest execution, x alone |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for out in outs:
        for arm, m in out["modes"].items():
            lines.append(f"| {out['workload']} | {arm} | {m['split']} | {_pm(m['emulated_s'])} | {m['wall_s']['mean']:.0f} | "
                         f"{m['utilization']['mean']:.2f} | {m['moves']['mean']:.0f} | {m['migrations']['mean']:.0f} | "
                         f"{_stretch(m)} |")
    lines += ["", "| ratio | " + " | ".join(o["workload"] for o in outs) + " |",
              "| --- | " + " | ".join("---:" for _ in outs) + " |"]
    for key, label in RATIO_LABELS.items():
        cells = [f"{o['ratios'][key]['mean']:.2f} ({o['ratios'][key]['min']:.2f}–{o['ratios'][key]['max']:.2f})"
                 if key in o["ratios"] else "–" for o in outs]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "| bound (emulated s) | " + " | ".join(o["workload"] for o in outs) + " |",
              "| --- | " + " | ".join("---:" for _ in outs) + " |",
              "| lower bound | " + " | ".join(f"{o['lower_bound_s']:,.0f}" for o in outs) + " |",
              "| batching-aware bound | " + " | ".join(f"{o['batched_bound_s']:,.0f}" for o in outs) + " |",
              "| time scale, execution workers | " + " | ".join(
                  f"x{o['time_scale']:g}, {o['options'].get('execution_workers', 1)}" for o in outs) + " |",
              "| repeats, git | " + " | ".join(f"{o['repeats']}, `{o['git'][:12]}`" for o in outs) + " |"]
    return "\n".join(lines)


def update_readme(path: Path, markdown: str, marker: str = "placement-tables") -> None:
    """Replace what stands between ``<!-- marker:start -->`` and ``<!-- marker:end -->`` in ``path``."""
    text = Path(path).read_text()
    pattern = re.compile(rf"(<!-- {marker}:start -->\n).*?(<!-- {marker}:end -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"{path} has no <!-- {marker}:start --> ... <!-- {marker}:end --> section")
    Path(path).write_text(pattern.sub(lambda m: m.group(1) + markdown + "\n" + m.group(2), text))


def git_revision() -> str:
    """The checkout's revision (``-dirty`` with uncommitted changes), for a benchmark's JSON."""
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if rev.returncode != 0:
        return "unknown"
    return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
