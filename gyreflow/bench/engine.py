"""``gyreflow bench engine``: the paged KV cache against one slot per request, in one invocation.

Four figures, each a ratio of two arms measured in the same run (rounds interleaved, mean and
spread over ``repeats``):

kv_memory_ratio
    Peak KV memory held by live requests (blocks x bytes per block), paged vs one ``max_seq_len``
    slot per request, on the agent workload (native agent loop, concurrent executions, equal
    ``max_batch``): the memory that concurrency needs. ``kv_memory_ratio_with_retained`` counts
    the finished sessions kept for prefix reuse as well (an evictable cache when paged, reserved
    slots when not). ``kv_memory_floor_ratio`` is the paged arm's live tokens at its peak against
    the slots: what any layout that holds each live request's tokens and nothing more would need.
short_context_tokens_per_s_ratio
    Tokens/s of the same agent workload (short contexts), paged vs slots.
ttft_chunked_ratio
    Time to first token of a short request submitted while a long prompt is being prefilled,
    with the prefill spread over iterations vs done in the iteration that admits it.
migration_vs_reprefill
    Per context length: a live request exported, serialised, imported into a second engine and
    resumed to its next token, vs the same sequence prefilled from scratch there (in-process:
    no network; ``gyreflow bench migration`` times the move between Dask workers).
"""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from gyreflow.bench.report import git_revision, spread
from gyreflow.engine.base import GenerationRequest, SamplingParams
from gyreflow.engine.runner import EngineRunner
from gyreflow.engine.torch_engine import TorchEngine
from gyreflow.model import ModelConfig, build_policy
from gyreflow.model.policy import LONG_CONTEXT

def agent_options() -> dict:
    """The engine the README's main job gives its rollout cells (batch, context, retained sessions)."""
    from gyreflow.config import RunConfig
    from gyreflow.recipes.common import engine_options

    return engine_options(RunConfig())


class FirstTokens:
    """A logits hook recording when each request is first sampled (``time.monotonic``)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}
        self._lock = threading.Lock()

    def __call__(self, request_ids, logits) -> None:
        now = time.monotonic()
        with self._lock:
            for rid in request_ids:
                self.at.setdefault(rid, now)


def agent_round(model, paged: bool, executions: int, seed: int) -> dict:
    """The agent workload on one engine: seconds, tokens/s, peak KV bytes."""
    from gyreflow.agents.loop import AgentConfig, run_agent
    from gyreflow.agents.tasks import make_tasks

    options = agent_options()
    engine = TorchEngine(model, kv_block_size=64 if paged else None, **options)
    tasks = make_tasks("heldout", executions, horizon=4, spare_calls=4)
    cfg = AgentConfig(temperature=1.0)
    t0 = time.perf_counter()
    with EngineRunner(engine, idle_timeout=0.05) as runner, ThreadPoolExecutor(options["max_batch"]) as pool:
        futures = [pool.submit(run_agent, task, lambda r: runner.submit(r).result(), cfg, f"e{i:04d}", seed=seed)
                   for i, task in enumerate(tasks)]
        results = [f.result() for f in futures]
    elapsed = time.perf_counter() - t0
    failed = [r for r in results if r.end_reason == "infra_failure"]
    if failed:
        raise RuntimeError(f"{len(failed)} executions failed on the engine: {failed[0]}")
    s = engine.stats()
    return {"seconds": elapsed, "tokens_per_s": s["tokens_generated"] / elapsed,
            "peak_kv_bytes": s["kv_peak_live_blocks"] * s["kv_bytes_per_block"],
            "peak_kv_bytes_with_retained": s["kv_peak_blocks"] * s["kv_bytes_per_block"], "tokens": s["tokens_generated"],
            "peak_live_tokens": s["kv_peak_live_tokens"],
            "peak_live_token_bytes": s["kv_peak_live_tokens"] * s["kv_bytes_per_block"] // s["kv_block_size"]}


def ttft_round(model, chunked: bool, long_tokens: int) -> float:
    """Seconds from submitting a short request, while a long prompt prefills, to its first token."""
    hook = FirstTokens()
    engine = TorchEngine(model, max_batch=4, max_seq_len=long_tokens + 64, logits_hook=hook,
                         prefill_step_tokens=2048 if chunked else None)
    rng = np.random.default_rng(0)
    with EngineRunner(engine, idle_timeout=0.05) as runner:
        long = runner.submit(GenerationRequest("long", rng.integers(0, 256, long_tokens).astype(np.int32),
                                               SamplingParams(max_tokens=1, seed=1)))
        while engine.stats()["live"] == 0:  # the long prompt is admitted: its prefill is under way
            time.sleep(0.001)
        t0 = time.monotonic()
        short = runner.submit(GenerationRequest("short", rng.integers(0, 256, 16).astype(np.int32),
                                                SamplingParams(max_tokens=2, seed=2)))
        short.result()
        long.result()
    return hook.at["short"] - t0


def migration_round(model, context: int) -> tuple[float, float]:
    """(migration, re-prefill) seconds for a live request with ``context`` tokens of KV."""
    rng = np.random.default_rng(context)
    ids = rng.integers(0, 256, context - 4).astype(np.int32)
    hook = FirstTokens()
    src = TorchEngine(model, max_batch=2, max_seq_len=context + 64)
    dst = TorchEngine(model, max_batch=2, max_seq_len=context + 64, logits_hook=hook)
    src.submit(GenerationRequest("m", ids, SamplingParams(max_tokens=32, seed=3)))
    while src.stats()["tokens_generated"] < 4:
        src.step()
    t0 = time.monotonic()
    state = pickle.loads(pickle.dumps(src.export_request("m")))  # what the wire carries
    fut = dst.import_request(state)
    while "m" not in hook.at:
        dst.step()
    migration = hook.at["m"] - t0
    seq = np.concatenate([state.prompt_ids, state.completion_ids]).astype(np.int32)
    t0 = time.monotonic()
    dst.submit(GenerationRequest("r", seq, SamplingParams(max_tokens=1, seed=3)))
    while "r" not in hook.at:
        dst.step()
    reprefill = hook.at["r"] - t0
    dst.drain()
    fut.result()
    return migration, reprefill


def run_engine_bench(repeats: int = 3, executions: int = 96, long_tokens: int = 100_000,
                     contexts: tuple[int, ...] = (8192, 32768, 65536), log=print) -> dict:
    """Every arm ``repeats`` times, interleaved; figures as ``gyreflow bench engine --json`` writes them."""
    policy = build_policy(ModelConfig(), seed=0)
    long_policy = build_policy(LONG_CONTEXT, seed=0)
    agent_round(policy, True, 8, seed=99)  # warm-up: lazy imports, allocator
    rounds: dict[str, list] = {"paged": [], "slots": [], "ttft_chunked": [], "ttft_unchunked": [],
                               **{f"migration_{c}": [] for c in contexts}}
    for rep in range(repeats):
        log(f"round {rep + 1}/{repeats}")
        for arm, paged in (("slots", False), ("paged", True)) if rep % 2 else (("paged", True), ("slots", False)):
            r = agent_round(policy, paged, executions, seed=rep)
            rounds[arm].append(r)
            log(f"  agent workload, {arm}: {r['tokens_per_s']:,.0f} tokens/s, peak live KV {r['peak_kv_bytes'] / 2**20:,.1f} MiB "
                f"({r['peak_kv_bytes_with_retained'] / 2**20:,.1f} MiB with retained sessions; "
                f"{r['peak_live_tokens']:,} live tokens at the peak)")
        for chunked in (True, False):
            s = ttft_round(long_policy, chunked, long_tokens)
            rounds["ttft_chunked" if chunked else "ttft_unchunked"].append(s)
            log(f"  first token beside a {long_tokens:,}-token prefill, {'chunked' if chunked else 'unchunked'}: {s:.3f} s")
        for c in contexts:
            m, p = migration_round(long_policy, c)
            rounds[f"migration_{c}"].append((m, p))
            log(f"  context {c:,}: migration {m:.3f} s, re-prefill {p:.3f} s")
    memory = [p["peak_kv_bytes"] / s["peak_kv_bytes"] for p, s in zip(rounds["paged"], rounds["slots"])]
    floor = [p["peak_live_token_bytes"] / s["peak_kv_bytes"] for p, s in zip(rounds["paged"], rounds["slots"])]
    retained = [p["peak_kv_bytes_with_retained"] / s["peak_kv_bytes_with_retained"]
                for p, s in zip(rounds["paged"], rounds["slots"])]
    speed = [p["tokens_per_s"] / s["tokens_per_s"] for p, s in zip(rounds["paged"], rounds["slots"])]
    ttft = [c / u for c, u in zip(rounds["ttft_chunked"], rounds["ttft_unchunked"])]
    migration = {str(c): spread([m / p for m, p in rounds[f"migration_{c}"]]) for c in contexts}
    return {
        "git": git_revision(),
        "repeats": repeats,
        "torch_threads": torch.get_num_threads(),
        "options": {"agent": {**agent_options(), "executions": executions, "paged_block": 64},
                    "long_tokens": long_tokens, "long_policy": LONG_CONTEXT.asdict()},
        "kv_memory_ratio": spread(memory),
        "kv_memory_ratio_with_retained": spread(retained),
        "kv_memory_floor_ratio": spread(floor),
        "short_context_tokens_per_s_ratio": spread(speed),
        "ttft_chunked_ratio": spread(ttft),
        "migration_vs_reprefill": {c: v["mean"] for c, v in migration.items()},
        "migration_vs_reprefill_spread": migration,
        "rounds": {k: v for k, v in rounds.items()},
    }


def format_engine(out: dict) -> str:
    lines = [f"engine bench: {out['repeats']} round(s), git {out['git']}"]
    for key in ("kv_memory_ratio", "kv_memory_ratio_with_retained", "kv_memory_floor_ratio",
                "short_context_tokens_per_s_ratio",
                "ttft_chunked_ratio"):
        v = out[key]
        lines.append(f"{key}: {v['mean']:.3f}x (min {v['min']:.3f}, max {v['max']:.3f})")
    for c, v in out["migration_vs_reprefill_spread"].items():
        lines.append(f"migration_vs_reprefill[{c}]: {v['mean']:.3f}x (min {v['min']:.3f}, max {v['max']:.3f})")
    return "\n".join(lines)
