"""`gyreflow bench migration`: resuming a migrated long generation against re-prefilling it.

A generation is in flight on one cell with ~``context_tokens`` tokens in its KV cache. Two ways
to carry it on elsewhere are timed, in the same run, on a real local Dask cluster (one worker
process per cell) with the real :class:`~gyreflow.engine.torch_engine.TorchEngine` serving the
default gyreflow policy:

migration
    The cell's ``gyreflow_drain`` RPC exports the request (KV cache, sampler state), sends it
    worker to worker over Dask comms as msgpack frames, and the destination imports and resumes
    it. Timed from the drain request until the destination samples the request's next token.
re-prefill
    The destination gets the same sequence (prompt and tokens sampled so far) as a fresh prompt,
    with no cached prefix, and ``max_tokens=1``. Timed from the generate request until the
    destination samples that token (a prefill of the whole sequence).

Both clocks are the host's ``CLOCK_MONOTONIC`` (``time.monotonic``), shared by all processes of
the local cluster: the start is read in the driver just before the RPC leaves, the end inside
the destination engine (its ``logits_hook``, called in the step that samples the token). Each
repeat also checks the moved generation: it must end with exactly its ``max_tokens`` tokens, and
(first repeat) equal, token for token and log-prob for log-prob, the same request never moved.

    python -m gyreflow.bench.migration                    # context 2,000, 5 repeats (+ 3,840)
    python -m gyreflow.bench.migration --context 300 --repeats 1 --larger 0 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import statistics
import time
from collections import Counter

import numpy as np
import torch
from distributed import Client, Nanny, Scheduler, SpecCluster

from gyreflow.cluster.local import workers_info
from gyreflow.cluster.pools import ROLLOUT, TRAINER
from gyreflow.engine.base import GenerationRequest, SamplingParams
from gyreflow.engine.service import PLUGIN_NAME, EngineService
from gyreflow.engine.wire import msg_to_result, request_to_msg
from gyreflow.train.state import PublishedWeights

HEADROOM = 256
"""Cache positions past ``context_tokens`` (the engine's ``max_seq_len`` is the largest context
plus this)."""
LEAD = 32
"""Tokens the generation samples on the source before it moves: its prompt is ``context - LEAD``."""
MAX_NEW = HEADROOM - LEAD
"""``max_tokens`` of the moved generation: still in flight when it moves, finished well inside
``max_seq_len``."""
RACE_ATTEMPTS = 5
"""Rounds tried when the generation finishes before the drain reaches it."""
DEFAULT_LARGER = 3840
"""The larger context run by default: the default policy's 4,096 positions less ``HEADROOM``."""


# ---------------------------------------------------------------------------- on the workers


class TokenClock:
    """An engine ``logits_hook`` that notes, per request id, when its first token was sampled
    here (``time.monotonic``) and how many tokens were sampled here."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.count: Counter = Counter()

    def __call__(self, request_ids: list[str], logits) -> None:
        t = time.monotonic()
        for rid in request_ids:
            self.first.setdefault(rid, t)
            self.count[rid] += 1


def _service(dask_worker):
    return dask_worker.plugins[PLUGIN_NAME]


def _install_clock(dask_worker=None) -> dict:
    engine = _service(dask_worker).runner.engine
    engine.logits_hook = TokenClock()
    return {"torch_threads": torch.get_num_threads(), "max_seq_len": engine.max_seq_len}


def _clock(request_ids: list[str], dask_worker=None) -> dict:
    clock = _service(dask_worker).runner.engine.logits_hook
    return {rid: (clock.first.get(rid), clock.count.get(rid, 0)) for rid in request_ids}


def _accept(dask_worker=None) -> None:
    """Serve again after a drain (the cell stays in the rollout pool)."""
    _service(dask_worker).accepting = True


def _engine_stats(dask_worker=None) -> dict:
    return _service(dask_worker).stats()


def _publish(published: PublishedWeights, dask_worker=None) -> dict:
    return _service(dask_worker).load(published.hf_config, published.weights, published.version)


# ---------------------------------------------------------------------------- the driver


def _generator_state_bytes() -> int:
    return int(torch.Generator(device="cpu").get_state().numel())


def kv_bytes(cfg, tokens: int) -> int:
    """Bytes of the float32 KV cache of ``tokens`` tokens for a ModelConfig."""
    head_dim = cfg.hidden_size // cfg.num_heads
    return int(cfg.num_layers * 2 * cfg.num_kv_heads * tokens * head_dim * 4)


class _Bench:
    def __init__(self, client: Client, cfg) -> None:
        self.client = client
        self.cfg = cfg
        self.gen_bytes = _generator_state_bytes()

    # RPCs straight from the driver to a worker, over the client's connection pool.
    def rpc_async(self, addr: str, op: str, **kwargs):
        async def call():
            return await getattr(self.client.rpc(addr), op)(**kwargs)

        return asyncio.run_coroutine_threadsafe(call(), self.client.loop.asyncio_loop)

    def rpc(self, addr: str, op: str, timeout: float = 120.0, **kwargs):
        return self.rpc_async(addr, op, **kwargs).result(timeout)

    def clock(self, addr: str, rids: list[str]) -> dict:
        return self.client.run(_clock, rids, workers=[addr])[addr]

    def wait_clock(self, addr: str, rid: str, count: int = 1, timeout: float = 60.0, pending=None) -> tuple[float, int]:
        """Poll ``addr``'s token clock until ``rid`` has ``count`` tokens sampled there."""
        deadline = time.monotonic() + timeout
        while True:
            first, n = self.clock(addr, [rid])[rid]
            if n >= count:
                return first, n
            if pending is not None and pending.done():
                raise RuntimeError(f"request {rid} ended on {addr} before it could be measured: {pending.result()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"request {rid} has {n} of {count} tokens on {addr} after {timeout} s")
            time.sleep(0.002)

    def round(self, src: str, dst: str, tag: str, context: int, seed: int, verify: bool) -> dict:
        """One generation moved ``src`` -> ``dst``, then the re-prefill of it on ``dst``."""
        rng = np.random.default_rng(seed)
        n_prompt = context - LEAD
        prompt = rng.integers(0, 256, size=n_prompt).astype(np.int32)
        params = SamplingParams(temperature=1.0, max_tokens=MAX_NEW, seed=seed)
        for attempt in range(RACE_ATTEMPTS):
            rid = f"{tag}-move" + (f"{attempt}" if attempt else "")
            reply = self.rpc_async(src, "gyreflow_generate",
                                   request=request_to_msg(GenerationRequest(rid, prompt, params)))
            self.wait_clock(src, rid, count=LEAD, pending=reply)

            # (a) migration: drain the source to the destination; ends at the next token sampled there.
            t0 = time.monotonic()
            drained = self.rpc(src, "gyreflow_drain", destinations=[dst])
            t_drained = time.monotonic()
            if drained.get("moved") == {rid: dst}:
                break
            # A short generation on a fast cell can finish between the token clock's poll and the
            # drain: nothing was in flight to move, so that round measures nothing; run it again.
            if not drained.get("moved") and not drained.get("kept") and "completion_ids" in reply.result(60):
                self.client.run(_accept, workers=[src])
                continue
            raise RuntimeError(f"drain of {src} did not move {rid} to {dst}: {drained}")
        else:
            raise RuntimeError(f"{rid} finished on {src} before each of {RACE_ATTEMPTS} drains")
        if reply.result(60) != {"moved": dst}:
            raise RuntimeError(f"the source's reply for {rid} does not point at {dst}")
        t_resumed, _ = self.wait_clock(dst, rid)
        self.client.run(_accept, workers=[src])
        n_src = self.clock(src, [rid])[rid][1]  # tokens sampled before the move
        n_cached = n_prompt + n_src - 1  # the last sampled token is not in the cache yet
        moved_bytes = int(drained["bytes"])

        final = msg_to_result(self.rpc(dst, "gyreflow_resume", request_id=rid))
        n_dst = self.clock(dst, [rid])[rid][1]
        continued = (len(final.completion_ids) == MAX_NEW and final.finish_reason == "length"
                     and n_src + n_dst == MAX_NEW and np.array_equal(final.prompt_ids, prompt))

        # (b) re-prefill: the same sequence as a fresh prompt on the destination.
        seq = np.concatenate([prompt, final.completion_ids[:n_src]]).astype(np.int32)
        rid_b = f"{tag}-reprefill"
        req_b = GenerationRequest(rid_b, seq, SamplingParams(temperature=1.0, max_tokens=1, seed=seed + 1))
        t0_b = time.monotonic()
        out_b = self.rpc(dst, "gyreflow_generate", request=request_to_msg(req_b))
        if "error" in out_b:
            raise RuntimeError(f"re-prefill on {dst}: {out_b['error']}")
        t_first_b, _ = self.wait_clock(dst, rid_b)

        run = {
            "source": src,
            "destination": dst,
            "context_tokens": context,
            "cached_tokens": n_cached,
            "tokens_before_move": n_src,
            "kv_bytes": moved_bytes - self.gen_bytes,
            "expected_kv_bytes": kv_bytes(self.cfg, n_cached),
            "state_bytes": moved_bytes,
            "migration_s": t_resumed - t0,
            "drain_rpc_s": t_drained - t0,
            "drain_s": float(drained["seconds"]),
            "reprefill_s": t_first_b - t0_b,
            "reprefill_tokens": int(len(seq)),
            "continued": bool(continued),
            "completion_tokens": int(len(final.completion_ids)),
        }
        if verify:  # the same request, never moved, on the destination
            ref = msg_to_result(self.rpc(dst, "gyreflow_generate",
                                         request=request_to_msg(GenerationRequest(f"{tag}-reference", prompt, params))))
            run["matches_unmoved"] = bool(np.array_equal(ref.completion_ids, final.completion_ids)
                                          and np.array_equal(ref.logprobs, final.logprobs))
        return run


def _summary(runs: list[dict]) -> dict:
    mig = statistics.median(r["migration_s"] for r in runs)
    pre = statistics.median(r["reprefill_s"] for r in runs)
    out = {
        "context_tokens": runs[0]["context_tokens"],
        "repeats": len(runs),
        "migration_s": mig,
        "reprefill_s": pre,
        "ratio": pre / mig,
        "migration_best_s": min(r["migration_s"] for r in runs),
        "reprefill_best_s": min(r["reprefill_s"] for r in runs),
        "drain_s": statistics.median(r["drain_s"] for r in runs),
        "cached_tokens": int(statistics.median(r["cached_tokens"] for r in runs)),
        "kv_bytes": int(statistics.median(r["kv_bytes"] for r in runs)),
        "kv_bytes_as_expected": all(r["kv_bytes"] == r["expected_kv_bytes"] for r in runs),
        "continued": all(r["continued"] for r in runs),
        "runs": runs,
    }
    verified = [r["matches_unmoved"] for r in runs if "matches_unmoved" in r]
    out["matches_unmoved"] = all(verified) if verified else None
    return out


@contextlib.contextmanager
def _quiet_dask():
    """Dask's INFO logs off while the cluster starts and stops (here and in the worker processes)."""
    logger = logging.getLogger("distributed")
    level, env = logger.level, os.environ.get("DASK_LOGGING__DISTRIBUTED")
    logger.setLevel(logging.ERROR)
    os.environ["DASK_LOGGING__DISTRIBUTED"] = env or "error"
    try:
        yield
    finally:
        logger.setLevel(level)
        if env is None:
            os.environ.pop("DASK_LOGGING__DISTRIBUTED", None)


def two_cells() -> SpecCluster:
    """A local cluster of two rollout cells (worker processes, as in
    :func:`gyreflow.cluster.local.local_cluster`), without the execution worker or dashboard."""
    workers = {
        f"cell-{i}": {"cls": Nanny, "options": {"nthreads": 2, "resources": {ROLLOUT: 1.0, TRAINER: 0.0}, "name": f"cell-{i}"}}
        for i in range(2)
    }
    scheduler = {"cls": Scheduler, "options": {"dashboard": False, "host": "127.0.0.1"}}
    return SpecCluster(workers=workers, scheduler=scheduler, name="gyreflow-bench-migration")


def run_migration_bench(context_tokens: int = 2000, repeats: int = 5, log=print,
                        larger_context: int | None = None, larger_repeats: int = 3) -> dict:
    """Time migration against re-prefill at ``context_tokens`` (and ``larger_context``, if given).

    Returns the figures of the main context at the top level (``migration_s``, ``reprefill_s``
    medians, ``ratio`` = re-prefill / migration, ``kv_bytes``, ``cached_tokens``, ``runs``...)
    and the larger context's under ``larger`` (``None`` when not run).
    """
    from gyreflow.model.policy import ModelConfig, build_policy, state_dict_numpy

    if context_tokens <= LEAD + 1:
        raise ValueError(f"context_tokens must exceed {LEAD + 1}")
    started = time.monotonic()
    cfg = ModelConfig()
    model = build_policy(cfg)
    published = PublishedWeights(1, "bench-migration", model.config.to_dict(), state_dict_numpy(model))
    n_params = sum(p.numel() for p in model.parameters())
    longest = max(context_tokens, larger_context or 0)
    options = {"max_batch": 4, "max_seq_len": longest + HEADROOM}
    result: dict = {}
    with _quiet_dask(), two_cells() as cluster, Client(cluster) as client:
        client.register_plugin(EngineService(options, torch_threads=1))
        cells = sorted(a for a, w in workers_info(client).items()
                       if str(w.get("name", "")).startswith("cell-"))
        if len(cells) != 2:
            raise RuntimeError(f"expected two cell workers, found {cells}")
        client.run(_publish, published, workers=cells)
        engines = client.run(_install_clock, workers=cells)
        log(f"cluster up in {time.monotonic() - started:.1f} s: cells {', '.join(cells)}; "
            f"policy {n_params / 1e6:.2f}M params, engine {options}, torch threads "
            f"{[e['torch_threads'] for e in engines.values()]}")
        bench = _Bench(client, cfg)
        a, b = cells

        def measure(context: int, n: int, seed0: int, warm: bool, verify: bool) -> dict:
            if warm:  # both directions, untimed: first allocations, first connections
                for i, (s, d) in enumerate([(a, b), (b, a)]):
                    bench.round(s, d, f"warm{context}-{i}", context, seed=seed0 + 100 + i, verify=False)
            runs = []
            for r in range(n):
                src, dst = (a, b) if r % 2 == 0 else (b, a)
                run = bench.round(src, dst, f"ctx{context}-{r}", context, seed=seed0 + r, verify=verify and r == 0)
                log(f"  context {context} repeat {r}: {run['cached_tokens']} cached tokens, "
                    f"{run['kv_bytes'] / 1e6:.2f} MB KV; migration {run['migration_s'] * 1e3:.1f} ms, "
                    f"re-prefill {run['reprefill_s'] * 1e3:.1f} ms")
                runs.append(run)
            return _summary(runs)

        result = measure(context_tokens, repeats, 1000, warm=True, verify=True)
        result["larger"] = (measure(larger_context, min(repeats, larger_repeats), 2000, warm=False, verify=False)
                            if larger_context else None)
        result["migrated_in"] = {w: s["migrated_in"] for w, s in client.run(_engine_stats, workers=cells).items()}
    result.update(
        model={"params": int(n_params), "layers": cfg.num_layers, "kv_heads": cfg.num_kv_heads,
               "head_dim": cfg.hidden_size // cfg.num_heads, "dtype": "float32"},
        engine_options=options,
        transport="tcp",
        seconds=time.monotonic() - started,
    )
    return result


def _row(s: dict) -> str:
    return (f"{s['context_tokens']:>7}  {s['cached_tokens']:>6}  {s['kv_bytes'] / 1e6:>7.2f} MB  "
            f"{s['migration_s'] * 1e3:>9.1f} ms  {s['reprefill_s'] * 1e3:>10.1f} ms  {s['ratio']:>6.2f}x  {s['repeats']:>3}")


def _speed(ratio: float) -> str:
    return f"{ratio:.2f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x slower"


def format_migration(result: dict) -> str:
    """A small table (medians) and the line ``migration vs re-prefill: X.XXx faster``."""
    m = result.get("model", {})
    lines = [
        f"migrating a live generation vs re-prefilling it: TorchEngine, {m.get('params', 0) / 1e6:.2f}M-param policy, "
        f"two cell processes, Dask {result.get('transport', 'tcp')} comms",
        "time from the request to the destination's next token (median)",
        "",
        f"{'context':>7}  {'cached':>6}  {'KV moved':>10}  {'migration':>12}  {'re-prefill':>13}  {'ratio':>7}  {'n':>3}",
        _row(result),
    ]
    if result.get("larger"):
        lines.append(_row(result["larger"]))
    for s in (result, result.get("larger")):
        if s and s["repeats"] > 1:
            lines.append(f"{'best':>7}  {'':>6}  {'':>10}  {s['migration_best_s'] * 1e3:>9.1f} ms  "
                         f"{s['reprefill_best_s'] * 1e3:>10.1f} ms  (context {s['context_tokens']})")
    checks = "continued to max_tokens" if result.get("continued") else "DID NOT CONTINUE CORRECTLY"
    if result.get("matches_unmoved") is not None:
        checks += ", equal to the unmoved run" if result["matches_unmoved"] else ", DIFFERS FROM THE UNMOVED RUN"
    lines += [
        "",
        f"moved generation: {checks}; drain (export + send + import) {result['drain_s'] * 1e3:.1f} ms",
        f"migration vs re-prefill: {_speed(result['ratio'])}",
    ]
    if result.get("larger"):
        lines.append(f"  at {result['larger']['context_tokens']} tokens: {_speed(result['larger']['ratio'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=2000, help="tokens in the generation's KV cache when it moves")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds; medians are reported")
    p.add_argument("--larger", type=int, default=DEFAULT_LARGER, help="a second, larger context (0: none)")
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)
    result = run_migration_bench(args.context, args.repeats, larger_context=args.larger or None)
    print(format_migration(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
