"""The agent workload against the torch engine, in-process.

Many concurrent executions of the native agent loop (:func:`gyreflow.agents.loop.run_agent`) call
one :class:`~gyreflow.engine.torch_engine.TorchEngine` through an
:class:`~gyreflow.engine.runner.EngineRunner`. Every call's prompt is the previous prompt, its
completion and a short tool reply, so the engine sees a stream of short requests: a reused session
prefix, a small prefill of new tokens, a few decode steps. Prints seconds, calls/s, tokens/s, the
engine's counters and a digest of every sampled token (equal digests: the same results).

    python benchmarks/engine_agent_workload.py                       # random weights, 200 executions
    python benchmarks/engine_agent_workload.py --checkpoint DIR      # a trained policy
    python benchmarks/engine_agent_workload.py --executions 400 --workers 128 --max-batch 128
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from gyreflow.agents.loop import AgentConfig, run_agent
from gyreflow.agents.tasks import make_tasks
from gyreflow.engine.runner import EngineRunner
from gyreflow.engine.torch_engine import TorchEngine
from gyreflow.model import ModelConfig, build_policy, load_policy
from gyreflow.trajectory.records import ExecutionResult


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--executions", type=int, default=200, help="agent executions per timed run")
    p.add_argument("--workers", type=int, default=64, help="executions running at once (client threads)")
    p.add_argument("--horizon", type=int, default=4, help="rooms per task (about two calls each)")
    p.add_argument("--spare-calls", type=int, default=4, help="calls allowed beyond two per room")
    p.add_argument("--max-tokens", type=int, default=8, help="longest completion of one call")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-batch", type=int, default=64, help="engine live requests")
    p.add_argument("--retain-sessions", type=int, default=None, help="engine retained sessions (default: --workers)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="engine context (prompt + completion)")
    p.add_argument("--checkpoint", default=None, help="Hugging Face checkpoint dir (default: random weights)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs; the best counts")
    p.add_argument("--seed", type=int, default=0, help="agent sampling seed (same seed: same results)")
    p.add_argument("--profile", type=int, default=0, help="print the N top functions of the engine thread (cProfile)")
    return p.parse_args()


def digest(results: list[ExecutionResult]) -> tuple[str, float]:
    """A hash of every call's sampled ids, and the sum of all log-probs, in execution order."""
    h = hashlib.sha256()
    total = 0.0
    for r in sorted(results, key=lambda r: r.execution_id):
        for c in r.calls:
            h.update(np.asarray(c.completion_ids, dtype=np.int32).tobytes())
            total += float(np.sum(c.logprobs, dtype=np.float64))
    return h.hexdigest()[:16], total


def run_workload(engine: TorchEngine, args: argparse.Namespace, n: int, tag: str, profile: cProfile.Profile | None = None):
    """Run ``n`` executions through a runner; return (seconds, results)."""
    tasks = make_tasks("heldout", n, horizon=args.horizon, spare_calls=args.spare_calls)
    cfg = AgentConfig(temperature=args.temperature, max_tokens_per_call=args.max_tokens)
    runner = EngineRunner(engine, idle_timeout=0.05, name=f"runner-{tag}")
    if profile is not None:
        # Profile only the engine thread: wrap its loop.
        loop = runner._loop

        def profiled_loop() -> None:
            profile.enable()
            try:
                loop()
            finally:
                profile.disable()

        runner._loop = profiled_loop
    t0 = time.perf_counter()
    with runner, ThreadPoolExecutor(args.workers) as pool:
        futures = [
            pool.submit(run_agent, task, lambda r: runner.submit(r).result(), cfg, f"{tag}-{i:05d}", seed=args.seed)
            for i, task in enumerate(tasks)
        ]
        results = [f.result() for f in futures]
    elapsed = time.perf_counter() - t0
    crashed = [r for r in results if r.end_reason == "infra_failure"]
    if crashed or runner.errors:
        raise RuntimeError(f"{len(crashed)} crashed executions; runner errors {runner.errors[:1]}; {crashed[:1]}")
    return elapsed, results


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_policy(args.checkpoint) if args.checkpoint else build_policy(ModelConfig())
    retain = args.workers if args.retain_sessions is None else args.retain_sessions
    options = dict(max_batch=args.max_batch, retain_sessions=retain, max_seq_len=args.max_seq_len, device=args.device)
    print(
        f"{args.executions} executions x horizon {args.horizon} (+{args.spare_calls} spare calls), {args.workers} workers, "
        f"max_tokens {args.max_tokens}; engine {options}; torch threads {torch.get_num_threads()}; "
        f"weights {args.checkpoint or 'random'}"
    )
    # Warm-up on its own engine: allocator, lazy imports, first-call paths.
    run_workload(TorchEngine(model, **options), args, min(16, args.executions), "warm")

    best = None
    for rep in range(args.repeats):
        engine = TorchEngine(model, **options)
        profile = cProfile.Profile() if args.profile and rep == 0 else None
        elapsed, results = run_workload(engine, args, args.executions, "run", profile)
        stats = engine.stats()
        calls = sum(len(r.calls) for r in results)
        tokens = stats["tokens_generated"]
        ids, logprob_sum = digest(results)
        print(
            f"run {rep}: {elapsed:.2f} s  {calls / elapsed:.1f} calls/s  {tokens / elapsed:.1f} tokens/s  "
            f"({calls} calls, {tokens} tokens, digest {ids}, logprob sum {logprob_sum:.4f})"
        )
        it = max(1, stats["iterations"])
        print(
            f"  engine: {stats['iterations']} iterations, {1000 * elapsed / it:.1f} ms/iteration, "
            f"{stats['finished'] / it:.1f} finished/iteration, {stats['prefill_tokens'] / it:.1f} prefill tokens/iteration, "
            f"{stats['tokens_generated'] / it:.1f} sampled/iteration, reused {stats['reused_tokens']} tokens, "
            f"prefilled {stats['prefill_tokens']}"
        )
        if profile is not None:
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
        best = elapsed if best is None else min(best, elapsed)
    print(f"best {best:.2f} s")


if __name__ == "__main__":
    main()
