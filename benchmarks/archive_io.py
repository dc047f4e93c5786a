"""Archive write/read throughput against a numpy.save/numpy.load baseline measured in the same run.

Writes the same synthetic executions (Zipf-like token ids, ragged calls whose prompts share
nothing: the worst case for the archive's trees; `gyreflow bench trajectories` measures agent-like
executions) once through the zarr
archive (``write_execution`` + ``commit_step``, read back with ``ArchiveReader.load_execution``)
and once as one ``.npy`` file per flat array per execution, and prints tokens/s, the
archive/numpy ratios and on-disk sizes. Reads follow writes, so both hit the page cache; the
ratio compares software overhead and bytes moved, not disk speed.

    python -m benchmarks.archive_io                      # 256 executions x 20 calls, ~10M tokens
    python -m benchmarks.archive_io --executions 32      # same tokens, 8x longer executions
    python -m benchmarks.archive_io --threads 4          # concurrent writers, as Dask tasks are
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from gyreflow.bench.trajectories import call_arrays
from gyreflow.storage import ArchiveReader, commit_step, create_archive, write_execution
from gyreflow.trajectory.records import CallRecord, ExecutionResult

VOCAB = 151_936
NUMPY_ARRAYS = (
    "prompt_tokens",
    "prompt_offsets",
    "completion_tokens",
    "completion_offsets",
    "logprobs",
    "versions",
)


def zipf_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """Token ids with a Zipf-like frequency profile, like natural text under a BPE vocabulary."""
    return ((rng.zipf(1.2, n) - 1) % VOCAB).astype(np.int32)


def make_executions(
    n_exec: int, n_calls: int, total_tokens: float, prompt_share: float, seed: int
) -> list[ExecutionResult]:
    """Synthetic executions whose calls total about ``total_tokens`` tokens."""
    rng = np.random.default_rng(seed)
    per_call = total_tokens / (n_exec * n_calls)
    out = []
    for e in range(n_exec):
        eid = f"bench-{e:05d}"
        calls = []
        for i in range(n_calls):
            n = max(2, int(rng.uniform(0.5, 1.5) * per_call))
            p = max(1, int(n * prompt_share))
            c = n - p
            calls.append(
                CallRecord(
                    execution_id=eid,
                    call_index=i,
                    call_id=f"{eid}-{i}",
                    role="policy",
                    prompt_ids=zipf_ids(rng, p),
                    completion_ids=zipf_ids(rng, c),
                    logprobs=-rng.exponential(1.0, c).astype(np.float32),
                    versions=np.zeros(c, dtype=np.int32),
                    engine="tcp://127.0.0.1:9000",
                    t_start=float(i),
                    t_end=float(i) + 0.5,
                )
            )
        out.append(
            ExecutionResult(
                execution_id=eid,
                task_id=f"task-{e // 8}",
                step=0,
                sample=e % 8,
                split="train",
                calls=calls,
                reward=float(rng.random()),
                passed=bool(rng.random() < 0.5),
                end_reason="done",
            )
        )
    return out


def disk_usage(path: Path) -> tuple[int, int]:
    """Bytes and file count under ``path``."""
    files = [f for f in path.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files), len(files)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_once(
    executions: list[ExecutionResult], flat: list[dict[str, np.ndarray]], base: Path, threads: int
) -> dict[str, float]:
    """One round of archive and numpy write + read into a fresh ``base``; seconds per phase."""
    base.mkdir(parents=True)
    arch = base / "archive.zarr"
    npdir = base / "npy"
    npdir.mkdir()

    def archive_write() -> None:
        create_archive(arch, {"benchmark": "archive_io"})
        if threads > 1:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda r: write_execution(arch, r), executions))
        else:
            for r in executions:
                write_execution(arch, r)
        commit_step(arch, 0, {"benchmark": True})

    def archive_read() -> None:
        reader = ArchiveReader(arch)
        for eid in reader.executions(0):
            reader.load_execution(0, eid)

    def numpy_write() -> None:
        for r, arrays in zip(executions, flat):
            for name in NUMPY_ARRAYS:
                np.save(npdir / f"{r.execution_id}.{name}.npy", arrays[name])

    def numpy_read() -> None:
        for r in executions:
            for name in NUMPY_ARRAYS:
                np.load(npdir / f"{r.execution_id}.{name}.npy")

    result = {
        "archive_write": timed(archive_write),
        "numpy_write": timed(numpy_write),
        "archive_read": timed(archive_read),
        "numpy_read": timed(numpy_read),
    }
    result["archive_bytes"], result["archive_files"] = disk_usage(arch)
    result["numpy_bytes"], result["numpy_files"] = disk_usage(npdir)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--executions", type=int, default=256)
    ap.add_argument("--calls", type=int, default=20, help="calls per execution")
    ap.add_argument("--tokens", type=float, default=10e6, help="total tokens (prompt+completion)")
    ap.add_argument("--prompt-share", type=float, default=0.75)
    ap.add_argument("--repeats", type=int, default=2, help="rounds; medians are reported")
    ap.add_argument("--threads", type=int, default=1, help="concurrent archive writers")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: temp)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    executions = make_executions(
        args.executions, args.calls, args.tokens, args.prompt_share, args.seed
    )
    # The baseline saves the calls' arrays, concatenated per execution (flattening not timed).
    flat = [call_arrays(r) for r in executions]
    n_tokens = sum(len(a["prompt_tokens"]) + len(a["completion_tokens"]) for a in flat)
    scratch = args.dir or Path(tempfile.mkdtemp(prefix="gyreflow-archive-bench-"))
    rounds = []
    try:
        # Fresh directories per round; deleting thousands of small files is slow on some file
        # systems (seconds here), so it happens once, after all timing.
        for i in range(args.repeats):
            rounds.append(run_once(executions, flat, scratch / f"round{i}", args.threads))
    finally:
        if args.dir is None:
            shutil.rmtree(scratch, ignore_errors=True)

    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        f"{args.executions} executions x {args.calls} calls, {n_tokens / 1e6:.2f}M tokens "
        f"({args.prompt_share:.0%} prompt), {args.repeats} round(s), medians; "
        f"archive writers: {args.threads}"
    )
    print(f"{'':14}{'archive':>14}{'numpy':>14}{'archive/numpy':>16}")
    for phase in ("write", "read"):
        a, n = n_tokens / med[f"archive_{phase}"], n_tokens / med[f"numpy_{phase}"]
        print(f"{phase + ' tok/s':14}{a / 1e6:>13.1f}M{n / 1e6:>13.1f}M{a / n:>16.2f}")
    ab, nb = med["archive_bytes"], med["numpy_bytes"]
    print(f"{'disk MB':14}{ab / 1e6:>14.1f}{nb / 1e6:>14.1f}{ab / nb:>16.2f}")
    print(f"{'files':14}{med['archive_files']:>14.0f}{med['numpy_files']:>14.0f}")


if __name__ == "__main__":
    main()
