"""Elastic pools on a real local Dask cluster: cells move between the rollout and trainer pools
while generations and executions run, and nothing is lost, repeated or changed by the moves.

One cluster of worker processes serves the whole module: cells ``cell-0`` and ``cell-1`` start in
the rollout pool, ``cell-2`` in the trainer pool, and ``execution-0`` holds the execution slots.
Placement is ``async`` (no cell moves by itself); the tests force moves through the plugin's
``gyreflow_move`` RPC, which applies a move as its control loop applies a policy's. Every result is
compared with the same request generated on an in-process engine that never moved.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import cloudpickle
import numpy as np
import pytest
import torch
from distributed import Client, Event, get_worker

from gyreflow.cluster.local import PoolSpec, install, local_cluster, workers_info
from gyreflow.cluster.modes import PLACEMENTS, PlacementMode
from gyreflow.cluster.moves import Deadlines
from gyreflow.cluster.pools import EXECUTION, ROLLOUT, TRAINER
from gyreflow.cluster.router import RequestRefused, Router
from gyreflow.engine.base import GenerationRequest, GenerationResult, SamplingParams
from gyreflow.engine.torch_engine import TorchEngine
from gyreflow.model import ModelConfig, build_policy, state_dict_numpy
from gyreflow.stages import publish_weights
from gyreflow.train.state import PublishedWeights
from support import wait_for

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
ENGINE_OPTIONS = {"max_batch": 8, "max_seq_len": 1024}
VERSION = 1
CELLS = ("cell-0", "cell-1", "cell-2")
SLOT = {EXECUTION: 1}
TRAIN = {TRAINER: 1}

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def model():
    return build_policy(TINY, seed=0)


@pytest.fixture(scope="module")
def published(model):
    return PublishedWeights(VERSION, "elastic-test", model.config.to_dict(), state_dict_numpy(model))


@pytest.fixture(scope="module")
def client():
    # The tasks below live in this test module, which the worker processes cannot import.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    with local_cluster(PoolSpec(rollout=2, trainer=1, execution_slots=16)) as cluster, Client(cluster) as c:
        c.wait_for_workers(4)
        install(c, torch_threads=1, engine_options=ENGINE_OPTIONS, mode="async")
        c.get_task_stream()  # installs the scheduler's task-stream recorder
        yield c


def reference(model, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """The requests on an in-process engine that never moves (and never reuses a session's KV)."""
    engine = TorchEngine(model, name="reference", version=VERSION, retain_sessions=0, **ENGINE_OPTIONS)
    futures = [engine.submit(r) for r in requests]
    for _ in range(100_000):
        if all(f.done() for f in futures):
            break
        engine.step()
    return [f.result(timeout=0) for f in futures]


def assert_same(a: GenerationResult, b: GenerationResult, atol: float = 1e-5) -> None:
    assert a.request_id == b.request_id
    np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol, rtol=0)
    np.testing.assert_array_equal(a.versions, b.versions)
    assert a.finish_reason == b.finish_reason


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n).astype(np.int32)


def request(rid: str, n: int, seed: int, session: str | None = None, max_tokens: int = 32) -> GenerationRequest:
    return GenerationRequest(rid, prompt(n, seed + 10_000), SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed),
                             session=session if session is not None else rid)


# ---------------------------------------------------------------------------- cluster helpers



def addresses(client: Client) -> dict[str, str]:
    """Worker name -> address (a restarted worker keeps its name, not its address)."""
    return {w["name"]: addr for addr, w in workers_info(client).items()}


def pools(client: Client) -> dict:
    """The plugin's status, with each cell's role."""
    status = client.sync(client.scheduler.gyreflow_pools)
    status["pools"] = {k: list(v) for k, v in status["pools"].items()}  # msgpack brings sequences as tuples
    status["moving"] = list(status["moving"])
    status["roles"] = {a: role for role in (ROLLOUT, TRAINER) for a in status["pools"][role]}
    return status


def route_of(client: Client, session: str) -> str | None:
    return client.sync(client.scheduler.gyreflow_where, session=session)["engine"]


def move(client: Client, addr: str, to: str) -> dict:
    """Apply a move as the plugin's control loop does; the move's log entry."""
    entry = client.sync(client.scheduler.gyreflow_move, cell=addr, to=to, reason="test")
    assert "error" not in entry and "aborted" not in entry, entry
    return entry


def move_watched(client: Client, addr: str, to: str) -> tuple[dict, dict]:
    """Like :func:`move`, and what the pools look like while the move is under way (its drain is
    held half a second once its generations are exported)."""
    armed = client.sync(client.scheduler.gyreflow_fault, cell=addr, point="after_export", times=1, delay_s=0.5)
    assert armed["armed"] == "after_export" and armed["times"] == 1
    out: dict = {}
    mover = threading.Thread(target=lambda: out.setdefault("entry", move(client, addr, to)))
    mover.start()
    status = wait_for(lambda: (lambda s: s if addr in s["moving"] else None)(pools(client)), timeout=10,
                      what="the move under way")
    probe = client.sync(client.scheduler.gyreflow_route, session="probe-during-move")["engine"]
    client.sync(client.scheduler.gyreflow_release, session="probe-during-move")
    mover.join(timeout=60)
    during = {"moving": status["moving"], "routed_to": probe}
    return out["entry"], during


def engine_stats(client: Client, addr: str) -> dict:
    return client.run(lambda dask_worker: dask_worker.plugins["gyreflow-engine"].stats(), workers=[addr])[addr]


def task_state(client: Client, key: str) -> str | None:
    def state(key, dask_scheduler=None):
        ts = dask_scheduler.tasks.get(key)
        return None if ts is None else ts.state

    return client.run_on_scheduler(state, key)


def slow_steps(client: Client, addr: str, times: int = 10**6) -> None:
    """Each of the next ``times`` engine steps of ``addr`` waits 10 ms first (0: full speed again),
    so a generation of hundreds of tokens there takes seconds however fast the box is."""
    armed = client.sync(client.scheduler.gyreflow_fault, cell=addr, point="engine_step", times=times, delay_s=0.01)
    assert "error" not in armed, armed


def layout(client: Client, published: dict, rollout=("cell-0", "cell-1"), trainer=("cell-2",)) -> dict[str, str]:
    """Bring the cluster to a known state: every cell alive with an engine at ``VERSION`` and the
    given roles, no session routed anywhere. Name -> address."""
    names = wait_for(lambda: (lambda a: a if all(n in a for n in (*CELLS, "execution-0")) else None)(addresses(client)),
                     timeout=60, what="all workers")
    for name in CELLS:
        addr = names[name]
        if "version" not in engine_stats(client, addr):  # a fresh (restarted) worker: no engine yet
            client.submit(publish_weights, published, key=f"publish-v{VERSION}-{name}-{time.time()}", workers=[addr],
                          allow_other_workers=False, pure=False).result(timeout=60)

    wait_for(lambda: sum(pools(client)["sessions"].values()) == 0, what="no session routed anywhere")
    roles = pools(client)["roles"]
    for name in rollout:
        if roles.get(names[name]) != ROLLOUT:
            move(client, names[name], ROLLOUT)
    for name in trainer:
        if roles.get(names[name]) != TRAINER:
            move(client, names[name], TRAINER)
    state = pools(client)
    assert state["pools"][ROLLOUT] == sorted(names[n] for n in rollout)
    assert state["pools"][TRAINER] == sorted(names[n] for n in trainer)
    for name in CELLS:
        stats = engine_stats(client, names[name])
        assert stats["version"] == VERSION and stats["live"] == 0 and stats["waiting"] == 0
        assert stats["accepting"] == (name in rollout)
    return names


# ---------------------------------------------------------------------------- tasks (run on workers)


async def one_call(req: GenerationRequest):
    """One model call through the router, from a coroutine task in an execution slot."""
    router = Router(session=req.session)
    try:
        res = await router.agenerate(req)
    finally:
        await router.aclose()
    return res, router.migrations, router.reroutes


async def one_streamed_call(req: GenerationRequest):
    """:func:`one_call`, also returning the tokens streamed to it while the call ran."""
    streamed: list[int] = []
    req.on_token = lambda tok, lp: streamed.append(tok)
    return *(await one_call(req)), streamed


def trainer_task(tag: str, seconds: float) -> dict:
    """A stand-in for a gradient task: where it ran and the cell's role before and after."""
    w = get_worker()
    before = dict(w.state.total_resources)
    time.sleep(seconds)
    return {"tag": tag, "worker": w.address, "before": before, "after": dict(w.state.total_resources)}


def gated_trainer_task(tag: str, seconds: float, gate: str) -> dict:
    """:func:`trainer_task` once Dask event ``gate`` is set."""
    Event(gate).wait(timeout=60)
    return trainer_task(tag, seconds)


def execution(eid: str, index: int, min_calls: int, max_tokens: int, stop: str) -> dict:
    """An agent-like execution: sequential calls of one session, each prompt extending the last
    call's prompt and completion, until ``stop`` is set (at least ``min_calls``)."""
    w = get_worker()
    w.__dict__.setdefault("_gyreflow_test_runs", []).append(eid)
    w.__dict__.setdefault("_gyreflow_test_calls", {})
    done = Event(stop)
    router = Router(session=eid)
    calls, ids, k = [], prompt(6, 500 + index), 0
    try:
        while k < min_calls or not done.is_set():
            req = GenerationRequest(f"{eid}/call-{k}", ids, SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                                                           seed=1000 * index + k), session=eid)
            res = router(req)
            calls.append((req, res))
            w._gyreflow_test_calls[eid] = k + 1
            ids = np.concatenate([ids, res.completion_ids, prompt(3, 7000 + 100 * index + k)])
            if len(ids) > 600:  # context compaction: start over with a fresh prompt
                ids = prompt(6, 9000 + 100 * index + k)
            k += 1
    finally:
        router.close()
    return {"eid": eid, "calls": calls, "migrations": router.migrations, "reroutes": router.reroutes}


# ---------------------------------------------------------------------------- tests


def test_live_generation_migrates_exactly(client, published, model):
    """A generation in flight moves with its KV cache and sampler state when its cell leaves the
    rollout pool, and finishes with the very tokens and log-probs it would have had unmoved."""
    names = layout(client, published)
    req = request("migrate-1", 12, seed=123, max_tokens=900)
    base = {n: engine_stats(client, names[n])["tokens_generated"] for n in CELLS}
    before = pools(client)
    for name in ("cell-0", "cell-1"):  # whichever serves it decodes slowly: it cannot finish before the move
        slow_steps(client, names[name])
    fut = client.submit(one_streamed_call, req, key="call-migrate-1", resources=SLOT, pure=False)

    src = wait_for(lambda: route_of(client, req.session), what="the session's route")
    src_name = next(n for n, a in names.items() if a == src)
    dst = names["cell-1" if src_name == "cell-0" else "cell-0"]
    try:
        slow_steps(client, dst, times=0)
        wait_for(lambda: engine_stats(client, src)["tokens_generated"] - base[src_name] >= 8, what="tokens generated")
        entry, during = move_watched(client, src, TRAINER)
    finally:
        slow_steps(client, src, times=0)
    # While it drains, the cell is out of routing and out of the policy's hands.
    assert during["moving"] == [src] and during["routed_to"] == dst

    res, migrations, reroutes, streamed = fut.result(timeout=60)
    assert entry["migrated"] == 1  # it was still in flight when the cell moved
    assert_same(res, reference(model, [req])[0])
    assert len(res.completion_ids) == 900 and res.finish_reason == "length"
    assert res.engine == dst
    assert migrations == 1 and reroutes == 0
    after = pools(client)
    assert after["migrations"] == before["migrations"] + 1
    assert after["moves"] == before["moves"] + 1
    assert after["pools"][TRAINER] == sorted([src, names["cell-2"]])
    assert engine_stats(client, dst)["migrated_in"] >= 1 and engine_stats(client, src)["migrated_out"] >= 1
    # It went on where it stopped: the two engines sampled its tokens once between them.
    dst_name = next(n for n, a in names.items() if a == dst)
    src_tokens = engine_stats(client, src)["tokens_generated"] - base[src_name]
    dst_tokens = engine_stats(client, dst)["tokens_generated"] - base[dst_name]
    assert src_tokens >= 8 and src_tokens + dst_tokens == 900
    # Its tokens were streamed to the caller from both engines, in order, none twice (the last
    # batch may arrive after the reply: the reply is authoritative).
    assert streamed == res.completion_ids[: len(streamed)].tolist() and len(streamed) > src_tokens


def test_cell_dying_mid_migration_loses_nothing(client, published, model):
    """The source cell exits once the destination holds its generations, before it answers anyone:
    every generation still completes on the destination, unchanged, exactly once."""
    names = layout(client, published)
    N = 1000
    src, dst = names["cell-0"], names["cell-1"]
    slow_steps(client, src)  # none of its generations can finish before the drain (it dies there)
    reqs = [request(f"crash-{i}", 5 + 3 * i, seed=200 + i, max_tokens=N) for i in range(4)]
    for r in reqs:  # all four sessions on the cell that will die
        out = client.sync(client.scheduler.gyreflow_route, session=r.session, engine=src)
        assert out == {"engine": src}
    in_before = engine_stats(client, dst)["migrated_in"]
    dst_base = engine_stats(client, dst)["tokens_generated"]
    base = engine_stats(client, src)["tokens_generated"]
    futs = [client.submit(one_call, r, key=f"call-{r.request_id}", resources=SLOT, pure=False) for r in reqs]
    wait_for(lambda: (lambda s: s["live"] == len(reqs) and s["tokens_generated"] - base >= 8 * len(reqs))(
        engine_stats(client, src)), what="all generations live on the source")

    async def drain_and_die(src, dst, dask_scheduler=None):
        try:
            out = await dask_scheduler.rpc(src).gyreflow_drain(destinations=[dst], fail_after_send=True)
        except Exception as err:
            return {"died": type(err).__name__}
        return {"answered": out}

    assert "died" in client.run_on_scheduler(drain_and_die, src, dst)
    results = [f.result(timeout=60) for f in futs]
    assert [f.status for f in futs] == ["finished"] * len(reqs)
    for r, (res, _, _), ref in zip(reqs, results, reference(model, reqs)):
        assert_same(res, ref)
        assert res.engine == dst and len(res.completion_ids) == N
    assert engine_stats(client, dst)["migrated_in"] == in_before + len(reqs)
    # Resumed, not restarted: the destination sampled only what the dead cell had not.
    assert engine_stats(client, dst)["tokens_generated"] - dst_base <= len(reqs) * (N - 8)
    # Each call ran once: one task per key, none retried.
    keys = [t["key"] for t in client.get_task_stream(start=0) if str(t["key"]).startswith("call-crash-")]
    assert sorted(keys) == sorted(f"call-{r.request_id}" for r in reqs)
    # The Nanny brings the cell back (a new process at a new address).
    restarted = wait_for(lambda: addresses(client).get("cell-0"), timeout=60, what="cell-0 restarted")
    assert restarted != src


def test_release_forgets_only_its_own_migrated_requests(client):
    """Where a migration took a request is kept until that request's session ends; another
    session whose id is a prefix of it ending changes nothing (``exec-1`` vs ``exec-10``)."""
    where = "tcp://127.0.0.1:1"
    scheduler = client.scheduler
    client.sync(scheduler.gyreflow_imported, request_ids=["exec-10/0", "exec-1/0", "exec-1"], engine=where)
    client.sync(scheduler.gyreflow_release, session="exec-1")
    assert client.sync(scheduler.gyreflow_locate, request_id="exec-1/0") == {"engine": None}
    assert client.sync(scheduler.gyreflow_locate, request_id="exec-1") == {"engine": None}
    assert client.sync(scheduler.gyreflow_locate, request_id="exec-10/0") == {"engine": where}
    client.sync(scheduler.gyreflow_release, session="exec-10")
    assert client.sync(scheduler.gyreflow_locate, request_id="exec-10/0") == {"engine": None}


def test_pools_change_while_executions_run(client, published, model):
    """Cells move both ways while executions make calls and trainer tasks come and go: every
    execution runs once and finishes, every call equals its unmoved reference, and trainer tasks
    run only on cells that are trainers while they run."""
    names = layout(client, published)
    c0, c1, c2 = (names[n] for n in CELLS)
    stop = f"stop-{time.time()}"
    Event(stop, client=client).clear()
    ex = names["execution-0"]

    def reset(dask_worker):
        dask_worker._gyreflow_test_runs, dask_worker._gyreflow_test_calls = [], {}

    def calls_made() -> dict[str, int]:
        return client.run(lambda dask_worker: dict(dask_worker._gyreflow_test_calls), workers=[ex])[ex]

    client.run(reset, workers=[ex])
    before = pools(client)
    eids = [f"exec-{i:02d}" for i in range(12)]
    execs = [client.submit(execution, eid, i, 3, 24, stop, key=eid, resources=SLOT, pure=False) for i, eid in enumerate(eids)]
    wait_for(lambda: sum(pools(client)["sessions"].values()) == len(eids), what="every execution routed")

    entries = [move(client, c0, TRAINER)]  # c0's generations move to c1
    trains = [client.submit(trainer_task, f"t{i}", 0.1, key=f"train-{i:02d}", resources=TRAIN, pure=False)
              for i in range(12)]
    train_out = [f.result(timeout=60) for f in trains]
    entries.append(move(client, c2, ROLLOUT))
    entries.append(move(client, c0, ROLLOUT))
    entries.append(move(client, c1, TRAINER))  # c1's generations move to c0 and c2
    made = calls_made()
    assert sorted(made) == eids
    wait_for(lambda: all(n > made[e] for e, n in calls_made().items()), what="every execution calling after the moves")
    assert not [f.key for f in execs if f.done()]  # the executions ran across all the moves
    Event(stop, client=client).set()
    outs = [f.result(timeout=60) for f in execs]

    # Every execution ran exactly once and finished.
    assert [f.status for f in execs] == ["finished"] * len(eids)
    runs = client.run(lambda dask_worker: list(dask_worker._gyreflow_test_runs), workers=[ex])[ex]
    assert sorted(runs) == eids
    stream = [t["key"] for t in client.get_task_stream(start=0) if str(t["key"]).startswith("exec-")]
    assert sorted(stream) == eids
    # The roles changed both ways, and the moves found generations to migrate.
    after = pools(client)
    assert after["moves"] == before["moves"] + 4
    assert after["pools"][ROLLOUT] == sorted([c0, c2]) and after["pools"][TRAINER] == [c1]
    assert after["migrations"] > before["migrations"]
    # Every call: a distinct request, served by a cell that was a rollout cell at some point, and
    # exactly what an engine that never moved gives.
    calls = [c for o in outs for c in o["calls"]]
    assert len({req.request_id for req, _ in calls}) == len(calls) >= 3 * len(eids)
    assert {res.engine for _, res in calls} <= {c0, c1, c2}
    for (req, res), ref in zip(calls, reference(model, [req for req, _ in calls])):
        assert_same(res, ref)
    assert sum(o["migrations"] + o["reroutes"] for o in outs) > 0
    # Trainer tasks: all done, each on a cell that was a trainer for the whole task.
    assert [f.status for f in trains] == ["finished"] * len(trains)
    for t in train_out:
        assert t["worker"] in (c0, c2)
        for res in (t["before"], t["after"]):
            assert res[TRAINER] == 1 and res[ROLLOUT] == 0, t


def test_trainer_task_waits_for_a_trainer_cell(client, published):
    """Trap: a trainer task submitted while no cell is a trainer sits in ``no-worker``, and new
    resources alone do not wake it; moving a cell to the trainer pool makes it run there."""
    names = layout(client, published, rollout=CELLS, trainer=())
    fut = client.submit(trainer_task, "waiting", 0.0, key="trap-no-worker", resources=TRAIN, pure=False)
    wait_for(lambda: task_state(client, fut.key) == "no-worker", what="the task in no-worker")
    time.sleep(0.3)
    assert task_state(client, fut.key) == "no-worker" and not fut.done()
    move(client, names["cell-2"], TRAINER)
    out = fut.result(timeout=30)
    assert out["worker"] == names["cell-2"] and out["before"][TRAINER] == 1


def test_queued_trainer_tasks_spread_to_a_new_trainer_cell(client, published):
    """Trap: restricted tasks are all sent to the one trainer cell at once; when a second cell
    joins the trainer pool, queued ones move to it."""
    names = layout(client, published)
    c1, c2 = names["cell-1"], names["cell-2"]
    # Every task waits for the move before it works, so none can finish before cell-1 joins,
    # however slow the machine.
    gate = f"trap-queued-go-{time.time()}"
    futs = [client.submit(gated_trainer_task, f"q{i}", 0.5, gate, key=f"trap-queued-{i}", resources=TRAIN, pure=False)
            for i in range(4)]

    def on(keys, dask_scheduler=None):
        tasks = [dask_scheduler.tasks.get(k) for k in keys]
        return [getattr(getattr(ts, "processing_on", None), "address", None) for ts in tasks]

    wait_for(lambda: client.run_on_scheduler(on, [f.key for f in futs]) == [c2] * 4, what="all four queued on cell-2")
    move(client, c1, TRAINER)
    Event(gate, client=client).set()
    outs = [f.result(timeout=30) for f in futs]
    where = [o["worker"] for o in outs]
    assert set(where) <= {c1, c2}
    # One task was running on cell-2 when cell-1 joined; of the three queued there, the plugin
    # moves enough to balance the two cells (Dask's own work stealing alone moved one here).
    assert where.count(c1) >= 2 and where.count(c2) >= 1, where
    for o in outs:
        assert o["before"][TRAINER] == 1 and o["after"][TRAINER] == 1


def test_router_reroutes_a_session_whose_cell_left(client, published, model):
    """A session's next call after its cell left the rollout pool goes to another engine, with no
    error and an unchanged result."""
    names = layout(client, published)
    r1, r2 = request("reroute-1", 9, seed=31, session="reroute"), request("reroute-2", 14, seed=32, session="reroute")
    first, moved = Event(f"first-{time.time()}", client=client), Event(f"moved-{time.time()}", client=client)

    def two_calls(r1, r2, first, moved):
        router = Router(session=r1.session)
        a = router(r1)
        Event(first).set()
        assert Event(moved).wait(timeout=60)
        b = router(r2)
        router.close()
        return a, b, router.reroutes, router.migrations

    fut = client.submit(two_calls, r1, r2, first.name, moved.name, key="call-reroute", resources=SLOT, pure=False)
    assert first.wait(timeout=60)
    src = route_of(client, "reroute")
    entry = move(client, src, TRAINER)
    moved.set()
    a, b, reroutes, migrations = fut.result(timeout=60)
    other = next(names[n] for n in ("cell-0", "cell-1") if names[n] != src)
    assert entry["migrated"] == 0
    assert a.engine == src and b.engine == other
    assert reroutes == 1 and migrations == 0
    ref_a, ref_b = reference(model, [r1, r2])
    assert_same(a, ref_a)
    assert_same(b, ref_b)


def test_a_request_no_engine_can_hold_is_refused_not_failed(client, published):
    """A prompt longer than the engines hold is the caller's error (a ``ValueError`` naming it),
    not an infrastructure failure; the engine goes on serving."""
    names = layout(client, published)
    too_long = request("refused-1", ENGINE_OPTIONS["max_seq_len"] + 10, seed=41)
    fut = client.submit(one_call, too_long, key="call-refused", resources=SLOT, pure=False)
    with pytest.raises(RequestRefused, match="prompt of 1034 tokens does not fit the engine.s context of 1024 tokens") as err:
        fut.result(timeout=60)
    assert isinstance(err.value, ValueError)
    res, _, _ = client.submit(one_call, request("refused-2", 8, seed=42, max_tokens=4), key="call-after-refused",
                              resources=SLOT, pure=False).result(timeout=60)
    assert res.engine in {names["cell-0"], names["cell-1"]} and len(res.completion_ids) >= 1


def test_colocated_moves_every_cell_to_training_and_back(client, published):
    """``colocated`` applied by the plugin: with no execution live, ready training takes every
    cell, the last rollout cell included; a call waiting for an engine brings them all back."""
    names = layout(client, published, rollout=CELLS, trainer=())

    def mode(m):
        assert client.sync(client.scheduler.gyreflow_placement, mode=m) == {"mode": m}

    mode("colocated")
    try:
        futs = [client.submit(trainer_task, f"colo-{i}", 1.0, key=f"colo-{i}", resources=TRAIN, pure=False)
                for i in range(6)]
        wait_for(lambda: len(pools(client)["pools"][TRAINER]) == 3, what="every cell in the trainer pool")
        assert {f.result(timeout=30)["before"][TRAINER] for f in futs} == {1}
        res, _, _ = client.submit(one_call, request("colo-call", 8, 1, max_tokens=4), resources=SLOT,
                                  pure=False).result(timeout=60)
        assert res.engine in names.values() and len(pools(client)["pools"][ROLLOUT]) == 3
        moves = pools(client)["move_log"]
        assert not any(m.get("error") for m in moves)
    finally:
        mode("async")


def started_trainer_task(tag: str, seconds: float) -> dict:
    """:func:`trainer_task` that first says it started (Dask event ``<tag>-started``)."""
    Event(f"{tag}-started").set()
    return trainer_task(tag, seconds)


def test_a_training_cell_hands_over_and_rolls_out(client, published):
    """A trainer cell moved to rollout while it trains: no trainer task starts there any more, its
    queued tasks run on the other trainer cell, the one it runs finishes there, then it rolls out."""
    names = layout(client, published, rollout=("cell-0",), trainer=("cell-1", "cell-2"))
    c1, c2 = names["cell-1"], names["cell-2"]
    first = [client.submit(started_trainer_task, f"hand-{i}", 2.0, key=f"hand-{i}", workers=[c], resources=TRAIN,
                           allow_other_workers=True, pure=False) for i, c in enumerate((c1, c2))]
    for i in range(2):
        assert Event(f"hand-{i}-started", client=client).wait(timeout=30)
    queued = [client.submit(trainer_task, f"hand-q{i}", 0.2, key=f"hand-q{i}", resources=TRAIN, pure=False)
              for i in range(4)]
    entry = move(client, c1, ROLLOUT)
    assert entry["handover_s"] > 0
    state = pools(client)
    assert state["roles"][c1] == ROLLOUT and state["roles"][c2] == TRAINER
    outs = [f.result(timeout=60) for f in first + queued]
    # The task running on cell-1 finished there; everything after ran on cell-2, a trainer then.
    assert outs[0]["worker"] == c1 and outs[0]["before"][TRAINER] == 1
    assert all(o["worker"] == c2 and o["before"][TRAINER] == 1 for o in outs[1:]), outs
    assert engine_stats(client, c1)["accepting"]


SEEN: list = []
"""Snapshots shown to the ``watching`` placement mode."""


@dataclasses.dataclass(frozen=True)
class WatchingPolicy:
    """Moves nothing (as ``async``) and keeps every snapshot it is shown."""

    name: str = "watching"

    def decide(self, snap):
        SEEN.append(snap)
        return []


def held_trainer_task(tag: str, gate: str) -> dict:
    """A trainer task that says it started (Dask event ``<tag>-started``), then runs until ``gate`` is set."""
    Event(f"{tag}-started").set()
    Event(gate).wait(timeout=60)
    return trainer_task(tag, 0.0)


def test_a_cell_handing_over_counts_in_the_pool_it_moves_to(client, published):
    """While a trainer cell hands over to rollout (out of both pools until its running trainer task
    ends), the policy sees it as a rollout cell being moved, not as a cell that left."""
    PLACEMENTS.register("watching")(PlacementMode("watching", WatchingPolicy, "records what it sees (tests)",
                                                  moves_cells=False))
    try:
        handover_watched(client, published)
    finally:
        PLACEMENTS.unregister("watching")


def handover_watched(client: Client, published) -> None:
    """The test above, while the ``watching`` mode is registered."""
    names = layout(client, published, rollout=("cell-0",), trainer=("cell-1", "cell-2"))
    c0, c1, c2 = names["cell-0"], names["cell-1"], names["cell-2"]
    gate = f"handover-gate-{time.time()}"
    held = client.submit(held_trainer_task, "held", gate, key=f"held-{gate}", workers=[c1], resources=TRAIN,
                         allow_other_workers=False, pure=False)
    assert Event("held-started", client=client).wait(timeout=30)
    assert client.sync(client.scheduler.gyreflow_placement, mode="watching") == {"mode": "watching"}
    out: dict = {}
    mover = threading.Thread(target=lambda: out.setdefault("entry", move(client, c1, ROLLOUT)))
    mover.start()
    try:
        wait_for(lambda: c1 in pools(client)["moving"] and c1 not in pools(client)["pools"][TRAINER], timeout=30,
                 what="the cell out of the trainer pool, handing over")
        seen = len(SEEN)
        wait_for(lambda: len(SEEN) > seen + 1, timeout=30, what="a snapshot taken during the hand-over")
        cells = {c.address: c for c in SEEN[-1].cells}
        assert c1 in cells and cells[c1].role == ROLLOUT and cells[c1].moving
        assert sorted(c.address for c in SEEN[-1].role(ROLLOUT)) == sorted([c0, c1])
        assert [c.address for c in SEEN[-1].role(TRAINER)] == [c2]
    finally:
        Event(gate, client=client).set()
        mover.join(timeout=60)
        assert client.sync(client.scheduler.gyreflow_placement, mode="async") == {"mode": "async"}
    assert held.result(timeout=30)["worker"] == c1
    assert out["entry"]["handover_s"] > 0 and pools(client)["roles"][c1] == ROLLOUT


def test_downscaling_spares_busy_cells(client, published):
    """Retiring workers (adaptive scaling) never takes a cell that serves sessions or trains."""
    names = layout(client, published)
    client.sync(client.scheduler.gyreflow_route, session="busy-session", engine=names["cell-0"])
    fut = client.submit(trainer_task, "downscale", 1.0, key="downscale-busy", resources=TRAIN, pure=False)
    wait_for(lambda: task_state(client, fut.key) == "processing", what="the trainer task assigned")

    def candidates() -> list[str]:
        """The cells Dask's own downscaling would retire (``Scheduler.workers_to_close``, which asks
        every scheduler plugin's ``valid_workers_downscaling``)."""
        closing = client.sync(client.scheduler.workers_to_close, n=len(CELLS) + 1)
        return sorted(a for a in closing if a != names["execution-0"])

    try:
        assert candidates() == [names["cell-1"]]  # cell-0 serves a session, cell-2 trains
    finally:
        fut.result(timeout=30)
        client.sync(client.scheduler.gyreflow_release, session="busy-session")
    assert candidates() == sorted(names[c] for c in CELLS)


def test_publishing_skips_a_cell_that_left(client, published):
    """A weights version published to cells one of which has left the cluster since they were
    listed: the others get it, and the publication returns instead of waiting for that cell."""
    from types import SimpleNamespace

    from gyreflow.stepgraph import publish

    names = layout(client, published)
    gone = "tcp://127.0.0.1:9"  # a cell no longer in the cluster (nothing listens there)
    out = publish(client, SimpleNamespace(publish=publish_weights), published, [names["cell-0"], gone, names["cell-1"]],
                  version=VERSION)
    assert [o["engine"] for o in out] == [names["cell-0"], names["cell-1"]]
    assert all(o["version"] == VERSION for o in out)


def deadlines(client: Client, **limits) -> None:
    """Set the plugin's deadlines for cells to answer (none given: the defaults)."""
    out = client.sync(client.scheduler.gyreflow_placement, mode="async",
                      deadlines=dataclasses.asdict(Deadlines(**limits)))
    assert out == {"mode": "async"}, out


@pytest.mark.parametrize("ask, point, call, limit", [("move", "set_role", "gyreflow_set_role", "answer_s"),
                                                     ("move", "before_export", "gyreflow_drain", "migration_s"),
                                                     ("retire", "before_export", "gyreflow_drain", "migration_s")])
def test_a_cell_that_does_not_answer_fails_its_move_and_its_late_answer_changes_nothing(client, published, ask, point,
                                                                                        call, limit):
    """A cell holds a step of a move or a retirement (its drain, or its role change) 2 s while the
    plugin waits 1 s at most: the move ends, failed and naming the cell and the call, and the cell
    serves rollout again at once; when the held step runs at last it changes nothing (a role change
    older than the restore is refused; a drain finds nothing to move and the engine takes calls)."""
    names = layout(client, published)
    c0 = names["cell-0"]
    deadlines(client, **{limit: 1.0})
    try:
        armed = client.sync(client.scheduler.gyreflow_fault, cell=c0, point=point, times=1, delay_s=2.0)
        assert armed["armed"] == point
        held_from = time.monotonic()
        if ask == "move":
            entry = client.sync(client.scheduler.gyreflow_move, cell=c0, to=TRAINER, reason="test")
        else:
            entry = client.sync(client.scheduler.gyreflow_retire, cell=c0)
        assert f"{c0} did not answer {call} within 1s" in entry.get("aborted", entry.get("error", "")), entry
        state = pools(client)
        assert state["moving"] == [] and state["roles"][c0] == ROLLOUT
        time.sleep(max(0.0, 2.0 - (time.monotonic() - held_from)) + 2.0)  # the held step has run by now
        assert pools(client)["roles"][c0] == ROLLOUT and engine_stats(client, c0)["accepting"]
        res, _, _ = client.submit(one_call, request(f"after-late-{ask}-{point}", 8, 5, max_tokens=4), resources=SLOT,
                                  pure=False).result(timeout=60)
        assert len(res.completion_ids) >= 1
        assert move(client, c0, TRAINER)["to"] == TRAINER  # the cell takes the next move
    finally:
        deadlines(client)


def test_a_second_move_of_a_cell_under_way_is_refused(client, published):
    """A move asked for a cell that is already moving, to the same role or not, is refused while
    the first runs; the first completes."""
    names = layout(client, published)
    c0 = names["cell-0"]
    armed = client.sync(client.scheduler.gyreflow_fault, cell=c0, point="after_export", times=1, delay_s=1.0)
    assert armed["armed"] == "after_export"
    out: dict = {}
    first = threading.Thread(target=lambda: out.setdefault("entry", move(client, c0, TRAINER)))
    first.start()
    wait_for(lambda: c0 in pools(client)["moving"], timeout=10, what="the first move under way")
    for to in (TRAINER, ROLLOUT):
        again = client.sync(client.scheduler.gyreflow_move, cell=c0, to=to, reason="test")
        assert again["aborted"] == "a move of the cell to trainer is under way", again
    first.join(timeout=60)
    assert out["entry"]["to"] == TRAINER and pools(client)["roles"][c0] == TRAINER
    applied = [m for m in pools(client)["move_log"] if m["cell"] == c0 and m.get("applied", 0) >= out["entry"]["decided"]]
    assert [m.get("aborted") is None for m in applied].count(True) == 1


def test_modes_that_move_cells_need_work_stealing():
    """Without Dask's work stealing a cell leaving the trainer pool could not hand its queued
    trainer tasks over: such a cluster is refused for the modes that move cells, not for async."""
    import dask

    from gyreflow.cluster.local import ClusterError

    with dask.config.set({"distributed.scheduler.work-stealing": False}):
        with local_cluster(PoolSpec(rollout=2, trainer=1, execution_slots=1)) as cluster, Client(cluster) as c:
            with pytest.raises(ClusterError, match="placement 'elastic' moves cells, which needs Dask's work stealing"):
                install(c, torch_threads=1, engine_options=ENGINE_OPTIONS, mode="elastic")
            install(c, torch_threads=1, engine_options=ENGINE_OPTIONS, mode="async")
            assert c.sync(c.scheduler.gyreflow_pools)["mode"] == "async"
