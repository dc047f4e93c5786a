"""The step graph's stages with emulated compute (labelled emulated wherever reported).

Executions are real ``async`` Dask tasks that make every model call through the real router to
the emulated engines on the cells (so re-routing and migration are the real ones); gradient
shares and updates are real tasks on trainer cells that wait the modelled time. Nothing else is
replaced.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from distributed import get_worker

from gyreflow.bench.workload import ExecutionSpec, Workload
from gyreflow.cluster.router import Router
from gyreflow.engine.base import GenerationRequest, GenerationResult, SamplingParams
from gyreflow.engine.service import PLUGIN_NAME as ENGINE_PLUGIN
from gyreflow.train.state import PolicyState, PublishedWeights


PROBE_EMULATED_S = 400.0
"""How long, in emulated seconds, a call waits before the router asks its engine where it stands
(a real run's router asks every 20 wall seconds: at x400 that would be 8,000 emulated seconds, and
a call on a cell that left would wait that long)."""


def messaging_s(sent: float, result: GenerationResult, received: float, rerouted: bool) -> float:
    """Wall seconds a call spent in messages rather than in its engine: from ``sent`` to the engine
    taking it in (unknown, so 0, for a call sent again elsewhere or migrated) and from its modelled
    end to ``received``."""
    there = result.received_at - sent if result.received_at is not None and not rerouted else 0.0
    back = received - result.finished_at if result.finished_at is not None else 0.0
    return max(0.0, there) + max(0.0, back)


async def emulated_execution(spec: ExecutionSpec, time_scale: float) -> dict:
    """One execution: its calls in order through the router, with the tool latency between them.

    The wall time its calls spend in Dask's messages is taken out of the tool waits that follow
    (as far as they last): on the emulated clock it would count ``time_scale`` times, where a
    real deployment's milliseconds are nothing against a call's seconds.
    """
    # On the workload's clock, but never more often than twice a wall second per call.
    router = Router(session=spec.execution_id, probe_s=max(0.5, PROBE_EMULATED_S / time_scale))
    t0 = time.time()
    versions, engines = [], set()
    owed = repaid = 0.0  # wall seconds of messaging, and how much of it the tool waits gave back
    try:
        for i, (tokens, tool_s) in enumerate(spec.calls):
            req = GenerationRequest(
                request_id=f"{spec.execution_id}/call-{i}",
                prompt_ids=np.array([spec.context_tokens(i)], np.int32),
                params=SamplingParams(max_tokens=int(tokens)),
                session=spec.execution_id,
            )
            tries, sent = router.reroutes + router.lost, time.time()
            res = await router.agenerate(req)
            owed += messaging_s(sent, res, time.time(), rerouted=router.reroutes + router.lost != tries)
            if int(res.completion_ids[0]) != int(tokens):
                raise RuntimeError(f"{req.request_id}: {int(res.completion_ids[0])} tokens generated, {tokens} asked")
            versions.append(int(res.versions[-1]))
            engines.add(res.engine)
            if tool_s > 0:
                wait = tool_s / time_scale
                give_back = min(wait, owed - repaid)
                repaid += give_back
                await asyncio.sleep(wait - give_back)
    finally:
        await router.aclose()
    return {"execution_id": spec.execution_id, "step": spec.step, "tokens": spec.tokens, "calls": spec.num_calls,
            "min_version": min(versions) if versions else -1, "engines": sorted(engines),
            "reroutes": router.reroutes, "migrations": router.migrations, "lost": router.lost,
            "messaging_s": owed, "repaid_s": repaid, "start": t0, "end": time.time()}


def emulated_tree(result: dict) -> dict:
    """An emulated execution's trainable tokens stand for its tree."""
    return result


def emulated_group(results: list[dict]) -> dict:
    return {"tokens": int(sum(r["tokens"] for r in results)), "min_version": min(r["min_version"] for r in results),
            "executions": len(results), "step": results[0]["step"]}


def emulated_gradient(group: dict, published: PublishedWeights, j: int, shares: int, workload: Workload) -> dict:
    """Share ``j`` of ``shares`` of one group's gradient work: ``t`` (of the group's step) per trained
    token on this cell (the group's tokens cut evenly, as sequence-parallel training of long paths
    would)."""
    start = time.time()
    tokens = group["tokens"] // shares + (group["tokens"] % shares if j == 0 else 0)
    time.sleep(workload.at(group["step"]).train_s_per_token * tokens / workload.time_scale)
    return {"tokens": tokens, "version": published.version, "oldest": group["min_version"],
            "worker": get_worker().address, "start": start, "end": time.time()}


def emulated_update(step: int, shares: list[dict], state: PolicyState, workload: Workload) -> PolicyState:
    """The optimizer step and weight publication: a fixed cost per step."""
    start = time.time()
    time.sleep(workload.cost.step_fixed_s / workload.time_scale)
    version = state.version + 1
    oldest = min(s["oldest"] for s in shares)
    return PolicyState(PublishedWeights(version, state.run), None, {
        "step": step, "trained_tokens": int(sum(s["tokens"] for s in shares)), "max_staleness": version - 1 - oldest,
        "shares": [{k: s[k] for k in ("worker", "start", "end", "tokens")} for s in shares],
        "update": {"worker": get_worker().address, "start": start, "end": time.time()}})


def emulated_weights(state: PolicyState) -> PublishedWeights:
    return state.published


def emulated_publish(published: PublishedWeights) -> dict:
    """The cell's emulated engine takes the version (the publication's cost is in the update)."""
    return get_worker().plugins[ENGINE_PLUGIN].load({}, {}, published.version)
