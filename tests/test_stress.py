"""Moves that cannot lose work, under stress, on a real local Dask cluster.

Hundreds of emulated executions (real routers, real migrations of their live generations, emulated
compute) run while cells are moved back and forth at a high rate and the scheduler re-balances
sessions, with a failure injected at every point of a move (before export, after export, during
import, after import, on the cell changing role), round after round. Every execution must finish
exactly once, every model call be answered exactly once (no generation completes twice anywhere),
every cell end in a role it can serve, and no round may hang.
"""

from __future__ import annotations

import random
from collections import Counter
import threading
import time

import pytest
from distributed import Client, wait

from gyreflow.bench.stages import emulated_execution
from gyreflow.bench.workload import Workload
from gyreflow.bench.emulated_engine import emulated_engine_factory
from gyreflow.cluster.clock import Clock
from gyreflow.cluster.control import Timing
from gyreflow.cluster.local import PoolSpec, install, local_cluster, workers_info
from gyreflow.cluster.pools import EXECUTION, ROLLOUT, TRAINER
from gyreflow.faults import POINTS
from support import wait_for

pytestmark = pytest.mark.timeout(300)

SCALE = 50.0
WORKLOAD = Workload.from_dict({
    "name": "stress", "description": "short calls, for a stress test",
    "cells": 4, "steps": 1, "staleness": 1, "tasks_per_step": 12, "samples_per_task": 5,
    "tokens_per_execution": {"dist": "uniform", "low": 1000, "high": 2600},
    "tokens_per_call": 200, "tool_output_tokens": 20,
    "tool_latency": {"dist": "constant", "value_full_batch_iterations": 20},
    "cost": {"decode_b_s": 0.0005, "a_over_b": 16, "max_batch": 16, "prefill_s_per_token": 0.0001,
             "train_share": 0.3, "step_fixed_s": 1.0, "kv_bytes_per_token": 16, "handoff_s": 0.05},
    "time_scale": SCALE, "seed": 11,
})


@pytest.fixture(scope="module")
def client():
    with local_cluster(PoolSpec(rollout=3, trainer=1, execution_slots=64)) as cluster, Client(cluster) as c:
        c.wait_for_workers(5)
        # Re-balance sessions often: evictions migrate generations too.
        install(c, None, {"workload": WORKLOAD, "quantum_s": 0.005}, "async", engine_factory=emulated_engine_factory,
                clock=Clock(scale=SCALE), timing=Timing(tick_s=0.5, rebalance_s=0.5, stall_s=600, stall_check_s=50))
        yield c


def cells(client: Client) -> dict[str, str]:
    info = workers_info(client)
    return {v["name"]: a for a, v in info.items() if str(v["name"]).startswith("cell-")}


def engine_stats(client: Client) -> dict[str, dict]:
    async def ask(addr):
        return await client.rpc(addr).gyreflow_engine_stats()

    return {name: client.sync(ask, addr) for name, addr in cells(client).items()}


def publish_all(client: Client) -> None:
    from gyreflow.bench.stages import emulated_publish
    from gyreflow.train.state import PublishedWeights

    done = [client.submit(emulated_publish, PublishedWeights(0, "stress"), workers=[a], allow_other_workers=False,
                          pure=False) for a in cells(client).values()]
    wait(done, timeout=60)


class Mover(threading.Thread):
    """Moves random cells to the other pool as fast as the plugin applies them (one rollout and
    one trainer cell kept), until stopped."""

    def __init__(self, client: Client, seed: int) -> None:
        super().__init__(daemon=True)
        self.client, self.rng, self.stop = client, random.Random(seed), threading.Event()
        self.entries: list[dict] = []

    def run(self) -> None:
        while not self.stop.is_set():
            status = self.client.sync(self.client.scheduler.gyreflow_pools)
            rollout, trainer = list(status["pools"][ROLLOUT]), list(status["pools"][TRAINER])
            pool = rollout if len(rollout) > 1 and (len(trainer) <= 1 or self.rng.random() < 0.5) else trainer
            if len(pool) <= 1:
                time.sleep(0.02)
                continue
            cell = self.rng.choice(pool)
            to = TRAINER if pool is rollout else ROLLOUT
            self.entries.append(self.client.sync(self.client.scheduler.gyreflow_move, cell=cell, to=to, reason="stress"))
            time.sleep(self.rng.uniform(0.0, 0.05))


def run_round(client: Client, tag: str, point: str | None, seed: int) -> dict:
    rng = random.Random(seed)
    names = cells(client)
    fired_before = 0
    if point is not None:  # armed on every cell, a few times each: sources and destinations alike
        for addr in names.values():
            out = client.sync(client.scheduler.gyreflow_fault, cell=addr, point=point, times=rng.randint(1, 2))
            assert out["armed"] == point
            fired_before += out["tripped"].get(point, 0)
    before = engine_stats(client)
    specs = [WORKLOAD.execution(seed, t, s) for t in range(WORKLOAD.tasks_per_step) for s in range(WORKLOAD.samples_per_task)]
    tag = f"{tag}-{seed}"
    mover = Mover(client, seed)
    mover.start()
    futures = [client.submit(emulated_execution, spec, SCALE, key=f"{tag}-{spec.execution_id}", resources={EXECUTION: 1},
                             pure=False) for spec in specs]
    try:
        done, not_done = wait(futures, timeout=120)
    finally:
        mover.stop.set()
        mover.join(timeout=60)
    assert not not_done, f"{len(not_done)} executions hung ({point})"
    results = client.gather(futures)
    after = engine_stats(client)
    fired = 0
    for addr in names.values():  # disarmed again; how often the point fired in this round
        out = client.sync(client.scheduler.gyreflow_fault, cell=addr, point=point or POINTS[0], times=0)
        fired += out["tripped"].get(point, 0) if point else 0
    return {"specs": specs, "results": results, "before": before, "after": after, "moves": mover.entries,
            "fired": fired - fired_before}


def finished_calls(before: dict, after: dict) -> int:
    return sum(after[n]["finished"] - before.get(n, {}).get("finished", 0) for n in after)


ROUNDS = 3


def outcomes(moves: list[dict]) -> Counter:
    return Counter(m.get("error") or m.get("aborted") or "applied" for m in moves)


@pytest.mark.parametrize("point", [None, *POINTS])
def test_moves_under_faults_lose_nothing(client, point):
    publish_all(client)
    rounds = [check_round(client, point, seed=100 + 10 * r + (POINTS.index(point) + 1 if point else 0))
              for r in range(ROUNDS)]
    # The moves really happened, with executions live; a fault aborts the move it hits, so a round
    # may see few applied, but not every round.
    assert sum(outcomes(moves)["applied"] for moves, _ in rounds) >= ROUNDS, [outcomes(m) for m, _ in rounds]
    if point is not None:  # the injected faults really fired (a round may see no move reach the point)
        assert sum(fired for _, fired in rounds) > 0, point


def check_round(client: Client, point: str | None, seed: int) -> tuple[list[dict], int]:
    """One round's checks; returns the moves it tried and how often the point fired."""
    out = run_round(client, f"stress-{point or 'none'}", point, seed)
    specs, results = out["specs"], out["results"]
    # Every execution finished exactly once, with every call answered with all its tokens.
    assert sorted(r["execution_id"] for r in results) == sorted(s.execution_id for s in specs)
    for spec, res in zip(specs, results):
        assert res["tokens"] == spec.tokens and res["calls"] == spec.num_calls
    # No generation completed twice anywhere: the engines finished exactly the calls made.
    assert finished_calls(out["before"], out["after"]) == sum(s.num_calls for s in specs)
    # The mover really tried, and every move it tried ended applied, aborted or refused: none hangs.
    assert len(out["moves"]) >= 3, outcomes(out["moves"])
    # Every cell serves a role, its engine takes calls exactly when it is a rollout cell.
    status = client.sync(client.scheduler.gyreflow_pools)
    assert not status["moving"] and not status["stalls"]
    roles = {a: r for r in (ROLLOUT, TRAINER) for a in status["pools"][r]}
    for name, addr in cells(client).items():
        assert addr in roles, name
        assert out["after"][name]["accepting"] == (roles[addr] == ROLLOUT), (name, roles[addr])
        assert out["after"][name]["live"] == 0 and out["after"][name]["waiting"] == 0
    assert not client.sync(client.scheduler.gyreflow_stalls)
    return out["moves"], out["fired"]


def test_a_cell_leaving_mid_run_loses_no_execution(client):
    """A rollout cell retired while executions run on it: its generations migrate first, every
    execution finishes once, and the cell is gone from both pools."""
    publish_all(client)
    status = client.sync(client.scheduler.gyreflow_pools)
    for addr in status["pools"][TRAINER][1:]:  # two rollout cells at least
        client.sync(client.scheduler.gyreflow_move, cell=addr, to=ROLLOUT, reason="test")
    specs = [WORKLOAD.execution(7, t, s) for t in range(6) for s in range(5)]
    before = engine_stats(client)
    futures = [client.submit(emulated_execution, spec, SCALE, key=f"leave-{spec.execution_id}", resources={EXECUTION: 1},
                             pure=False) for spec in specs]
    victim = wait_for(lambda: next((e for e, n in client.sync(client.scheduler.gyreflow_pools)["sessions"].items()
                                    if n >= 3), None), what="a rollout cell serving executions")
    victim_name = next(n for n, a in cells(client).items() if a == victim)
    entry = client.sync(client.scheduler.gyreflow_retire, cell=victim)
    assert "error" not in entry, entry
    results = client.gather(futures)
    assert sorted(r["execution_id"] for r in results) == sorted(s.execution_id for s in specs)
    assert all(r["tokens"] == s.tokens for r, s in zip(results, specs))
    assert entry["migrated"] >= 1  # it held generations in flight when it left
    status = client.sync(client.scheduler.gyreflow_pools)
    assert victim not in status["pools"][ROLLOUT] and victim not in status["pools"][TRAINER]
    after = engine_stats(client)
    # What the victim finished before it went, plus what the others finished, is every call once.
    survivors = {n: s for n, s in after.items() if n in before}
    gone = set(before) - set(after)
    assert victim_name in gone or all(a != victim for a in cells(client).values())
    assert finished_calls({n: before[n] for n in survivors}, survivors) <= sum(s.num_calls for s in specs)


def test_stalled_executions_are_named_with_what_they_wait_on(client):
    """An execution whose generation is held mid-migration, and one busy in its own tool, are named
    once their silence passes the stall limit; both clear when they move on."""
    publish_all(client)
    status = client.sync(client.scheduler.gyreflow_pools)
    assert len(status["pools"][ROLLOUT]) >= 2
    timing = {"tick_s": 0.5, "rebalance_s": 1e9, "stall_s": 0.5 * SCALE, "stall_check_s": 1e9}
    assert client.sync(client.scheduler.gyreflow_placement, mode="async", timing=timing) == {"mode": "async"}
    try:
        long_call = WORKLOAD.execution(0, 0, 0)
        long_call = type(long_call)(**{**long_call.__dict__, "execution_id": "held", "calls": ((20000, 0.0),)})
        tool = type(long_call)(**{**long_call.__dict__, "execution_id": "in-tool", "calls": ((10, 3.0 * SCALE), (10, 0.0))})
        futs = [client.submit(emulated_execution, spec, SCALE, key=f"stall-{spec.execution_id}",
                              resources={EXECUTION: 1}, pure=False) for spec in (long_call, tool)]
        src = wait_for(lambda: client.sync(client.scheduler.gyreflow_where, session="held")["engine"],
                       what="the long call routed")
        # Hold the long call's generation half-way through a move, exported, for 3 s.
        client.sync(client.scheduler.gyreflow_fault, cell=src, point="after_export", times=1, delay_s=3.0)
        mover = threading.Thread(target=lambda: client.sync(client.scheduler.gyreflow_move, cell=src, to=TRAINER))
        mover.start()
        time.sleep(1.5)
        stalls = {s["execution"]: s for s in client.sync(client.scheduler.gyreflow_stalls)}
        assert "exported" in stalls["held"]["waits_on"] and src in stalls["held"]["waits_on"]
        assert stalls["in-tool"]["waits_on"] == "its agent or a tool (no model call in flight)"
        assert stalls["held"]["seconds"] >= timing["stall_s"]
        status = client.sync(client.scheduler.gyreflow_pools)
        assert {s["execution"] for s in status["stalls"]} == {"held", "in-tool"}  # what the dashboard shows
        mover.join(timeout=60)
        assert [f.result(timeout=60)["execution_id"] for f in futs] == ["held", "in-tool"]
        assert not client.sync(client.scheduler.gyreflow_stalls)
    finally:
        client.sync(client.scheduler.gyreflow_placement, mode="async",
                    timing={"tick_s": 0.5, "rebalance_s": 0.5, "stall_s": 600, "stall_check_s": 50})


def test_an_execution_on_an_engine_that_does_not_answer_is_named(client):
    """An execution whose engine's event loop is blocked is named as waiting on that engine, found
    within the deadline for an answer, and finishes once the engine runs again."""
    publish_all(client)
    timing = {"tick_s": 0.5, "rebalance_s": 1e9, "stall_s": 0.5 * SCALE, "stall_check_s": 1e9}
    out = client.sync(client.scheduler.gyreflow_placement, mode="async", timing=timing, deadlines={"answer_s": 1.0})
    assert out == {"mode": "async"}

    async def block(seconds: float) -> None:
        time.sleep(seconds)  # on the worker's event loop: nothing else runs there meanwhile

    try:
        spec = WORKLOAD.execution(0, 0, 0)
        spec = type(spec)(**{**spec.__dict__, "execution_id": "on-blocked", "calls": ((20000, 0.0),)})
        fut = client.submit(emulated_execution, spec, SCALE, key="stall-on-blocked", resources={EXECUTION: 1},
                            pure=False)
        engine = wait_for(lambda: client.sync(client.scheduler.gyreflow_where, session="on-blocked")["engine"],
                          what="the call routed")
        client.run(block, 4.0, workers=[engine], wait=False)
        time.sleep(1.0)  # past the stall limit (0.5 s) since the call was routed
        stalls = {s["execution"]: s for s in client.sync(client.scheduler.gyreflow_stalls)}
        assert stalls["on-blocked"]["waits_on"] == \
            f"engine {engine}: it did not answer (its event loop is blocked, or it left)"
        assert fut.result(timeout=60)["execution_id"] == "on-blocked"
        assert not client.sync(client.scheduler.gyreflow_stalls)
    finally:
        client.sync(client.scheduler.gyreflow_placement, mode="async",
                    timing={"tick_s": 0.5, "rebalance_s": 0.5, "stall_s": 600, "stall_check_s": 50},
                    deadlines={"answer_s": 60.0})


@pytest.mark.parametrize("tool_emulated_s", [10.0, 150.0])
def test_an_execution_gives_the_time_its_calls_spent_in_messages_back_out_of_its_tool_waits(client, tool_emulated_s):
    """A call whose result cannot leave its engine (the engine's event loop blocked 1.5 s) spends
    that time in messages; the tool wait after it is shortened by as much of it as the wait lasts."""
    publish_all(client)

    async def block(seconds: float) -> None:
        time.sleep(seconds)

    spec = WORKLOAD.execution(0, 0, 0)
    spec = type(spec)(**{**spec.__dict__, "execution_id": f"held-reply-{tool_emulated_s:g}",
                         "calls": ((5000, tool_emulated_s), (10, 0.0))})
    fut = client.submit(emulated_execution, spec, SCALE, key=f"messaging-{spec.execution_id}",
                        resources={EXECUTION: 1}, pure=False)
    engine = wait_for(lambda: client.sync(client.scheduler.gyreflow_where, session=spec.execution_id)["engine"],
                      what="the call routed")
    client.run(block, 1.5, workers=[engine], wait=False)  # the call's modelled end (~0.9 s) falls inside
    out = fut.result(timeout=60)
    tool_wall = tool_emulated_s / SCALE
    assert out["messaging_s"] >= 0.5, out
    if tool_wall < 0.5:  # the whole wait given back (0.2 s)
        assert out["repaid_s"] == pytest.approx(tool_wall, rel=1e-9), out
    else:  # the held reply given back (3 s of wait); not the last call's messages, no wait follows them
        assert 0.5 <= out["repaid_s"] < out["messaging_s"], out


def test_a_cell_whose_role_change_fails_twice_serves_again_after_its_failed_move(client):
    """The move to training fails at the role change after the drain, and so does the first try to
    put the cell back: it must still end in the rollout pool taking calls (drained and never told
    its role again, it would keep its rollout resources and refuse every call)."""
    publish_all(client)
    status = client.sync(client.scheduler.gyreflow_pools)
    addr = sorted(status["pools"][ROLLOUT])[0]
    name = {a: n for n, a in cells(client).items()}[addr]
    before = client.sync(client.scheduler.gyreflow_fault, cell=addr, point="set_role", times=2)["tripped"]
    entry = client.sync(client.scheduler.gyreflow_move, cell=addr, to=TRAINER, reason="test")
    after = client.sync(client.scheduler.gyreflow_fault, cell=addr, point="set_role", times=0)["tripped"]
    assert after.get("set_role", 0) - before.get("set_role", 0) == 2, entry
    assert "aborted" in entry or "error" in entry, entry
    assert addr in client.sync(client.scheduler.gyreflow_pools)["pools"][ROLLOUT]
    assert engine_stats(client)[name]["accepting"] is True
