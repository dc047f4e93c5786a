"""Benchmark workloads and the emulated engine (no cluster; emulated-time bookkeeping, not wall time)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import threading
import time

import numpy as np
import pytest

from gyreflow.bench import (
    Cost,
    EmulatedEngine,
    Workload,
    WorkloadError,
    available_workloads,
    emulated_engine_factory,
    emulated_tokens_bytes,
    load_workload,
    lower_bound,
)
from gyreflow.bench.stages import messaging_s
from gyreflow.engine.base import GenerationRequest, GenerationResult, RequestExported, SamplingParams
from gyreflow.engine.runner import EngineRunner

# ------------------------------------------------------------------------------------ workloads


def test_shipped_workloads_load():
    assert {"xlong-tail", "flat"} <= set(available_workloads())
    x = load_workload("xlong-tail")
    f = load_workload("flat")
    assert (x.name, f.name) == ("xlong-tail", "flat")
    for w in (x, f):
        assert (w.cells, w.steps, w.staleness, w.tasks_per_step, w.samples_per_task) == (8, 6, 1, 32, 8)
        assert w.executions_per_step == 256
        assert w.tokens_per_call == 2000
        assert Workload.from_dict(json.loads(json.dumps(w.to_dict()))) == w
    assert x.tokens_per_execution.dist == "lognormal" and x.tokens_per_execution.cap == 700000
    assert (f.tokens_per_execution.dist, f.tokens_per_execution.low, f.tokens_per_execution.high) == ("uniform", 50000, 70000)
    # the same cost model and seed: only the token distribution differs
    assert x.cost == f.cost and x.seed == f.seed and x.tool_latency == f.tool_latency


def test_load_by_path_and_unknown_name(tmp_path):
    data = load_workload("flat").to_dict()
    data["name"] = "mine"
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    assert load_workload(path).name == "mine"
    assert load_workload(str(path)).name == "mine"
    with pytest.raises(WorkloadError, match="no-such-workload"):
        load_workload("no-such-workload")
    with pytest.raises(WorkloadError, match="missing.json"):
        load_workload(tmp_path / "missing.json")


def _edit(data: dict, dotted: str, value) -> dict:
    *parents, last = dotted.split(".")
    node = data
    for p in parents:
        node = node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return data


_DELETE = object()


def _refusal(path, data: dict) -> str:
    """The message ``load_workload`` refuses ``data`` with, written to ``path``."""
    path.write_text(json.dumps(data))
    with pytest.raises(WorkloadError) as err:
        load_workload(path)
    return str(err.value)


@pytest.mark.parametrize(
    "field, value, reason",
    [
        ("cells", _DELETE, "missing"),
        ("steps", "6", "integer"),
        ("steps", 2.5, "integer"),
        ("staleness", -1, "negative"),
        ("tasks_per_step", 0, "positive"),
        ("time_scale", True, "number"),
        ("cost.max_batch", 0, "positive"),
        ("cost.decode_b_s", -0.1, "positive"),
        ("cost.train_share", 1.0, "below 1"),
        ("cost.handoff_s", _DELETE, "missing"),
        ("cost.bogus", 1, "unknown"),
        ("extra_field", 1, "unknown"),
        ("tokens_per_execution.dist", "pareto", "unknown distribution"),
        ("tokens_per_execution.median", 0, "positive"),
        ("tokens_per_execution.mean", 5, "unknown"),
        ("tool_latency.median", 200, "unknown"),  # it is median_full_batch_iterations
        ("tool_latency", [1, 2], "object"),
    ],
)
def test_bad_workload_names_file_and_field(tmp_path, field, value, reason):
    msg = _refusal(tmp_path / "bad.json", _edit(load_workload("xlong-tail").to_dict(), field, value))
    assert "bad.json" in msg and reason in msg and repr(field) in msg


@pytest.mark.parametrize(
    "field, value, named, reason",
    [
        # an uncapped lognormal of sigma 3 reaches about 4e12 tokens: refused, with the fix named
        ("tokens_per_execution", {"dist": "lognormal", "median": 60000, "sigma": 3.0}, "tokens_per_execution",
         "give it a cap"),
        ("tokens_per_execution", {"dist": "lognormal", "median": 60000, "sigma": 1000.0}, "tokens_per_execution",
         "give it a cap"),
        ("tokens_per_call", 1, "tokens_per_execution", "700,000 calls"),  # the cap, one token a call
        ("cost.kv_bytes_per_token", 10**6, "cost.kv_bytes_per_token", "805,000-token context"),  # 700,000 + 350 x 300
        ("time_scale", 1e-300, "time_scale", "between 0.001 and 10000"),
        ("time_scale", 10**400, "time_scale", "out of range"),
        ("timeline", [{"at": 5, "leave": ["cell-1", "cell-1"]}], "timeline[0].leave", "'cell-1' more than once"),
    ],
)
def test_workload_the_benchmark_cannot_hold_is_refused(tmp_path, field, value, named, reason):
    path = tmp_path / "big.json"
    msg = _refusal(path, _edit(load_workload("xlong-tail").to_dict(), field, value))
    assert msg.startswith(f"{path}: field {named!r}") and reason in msg


def test_a_schedule_entry_is_named_when_it_is_the_one_too_large(tmp_path):
    data = load_workload("xlong-tail").to_dict()
    data["schedule"] = [{"from_step": 3, "tokens_per_execution": {"dist": "constant", "value": 2e8}}]
    assert re.search(r"late.json: field 'schedule\[0\].tokens_per_execution' reaches 200,000,000 tokens at step 3",
                     _refusal(tmp_path / "late.json", data))


def test_unreadable_or_repeated_keys_name_the_file(tmp_path):
    path = tmp_path / "twice.json"
    path.write_text('{"cells": 8, "cells": 3}')
    with pytest.raises(WorkloadError, match="twice.json: field 'cells' is given more than once"):
        load_workload(path)
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"name": "caf\xe9"}')
    with pytest.raises(WorkloadError, match="latin1.json: cannot be read as UTF-8"):
        load_workload(path)


def test_not_json(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{nope")
    with pytest.raises(WorkloadError, match="broken.json.*JSON"):
        load_workload(path)


def test_executions_are_deterministic_and_well_formed():
    w1, w2 = load_workload("xlong-tail"), load_workload("xlong-tail")
    a, b = w1.executions(2), w2.executions(2)
    assert a == b
    assert len(a) == 256 and len({e.execution_id for e in a}) == 256
    assert w1.executions(3) != a  # other steps draw other executions
    for e in a[:40]:
        n = math.ceil(e.tokens / 2000)
        assert e.num_calls == n and sum(t for t, _ in e.calls) == e.tokens
        assert all(t == 2000 for t, _ in e.calls[:-1]) and 0 < e.calls[-1][0] <= 2000
        assert e.calls[-1][1] == 0.0 and all(lat > 0 for _, lat in e.calls[:-1])
        assert e.context_tokens(0) == 300 and e.context_tokens(1) == 300 + 2000 + 300
    other_seed = dataclasses.replace(w1, seed=1)
    assert other_seed.executions(2) != a


def test_distributions_sanity():
    x = dataclasses.replace(load_workload("xlong-tail"), tasks_per_step=250)  # 2000 executions a step
    tokens = np.array([e.tokens for k in (0, 1) for e in x.executions(k)])
    assert abs(np.median(tokens) / 60000 - 1) < 0.1
    assert tokens.max() <= 700000 and tokens.min() >= 1
    assert (tokens == 700000).sum() >= 1  # the tail reaches the cap in 4000 draws (P ~ 0.7%)
    lat = np.array([lat for e in x.executions(0)[:300] for _, lat in e.calls[:-1]])
    assert abs(np.median(lat) / x.tool_latency_median_s - 1) < 0.1
    f = load_workload("flat")
    ft = np.array([e.tokens for k in range(f.steps) for e in f.executions(k)])
    assert ft.min() >= 50000 and ft.max() <= 70000
    assert abs(ft.mean() - 60000) < 1000


def test_derived_numbers_and_train_calibration():
    w = load_workload("xlong-tail")
    assert w.b == pytest.approx(0.0005) and w.a == pytest.approx(16 * 0.0005)
    assert w.iteration_s(32) == pytest.approx(0.008 + 0.0005 * 32)
    # alone, a generation runs ~2.8x faster per token than at a full batch of 32
    assert w.iteration_s(32) / w.iteration_s(1) == pytest.approx(48 / 17)
    assert w.tool_latency_median_s == pytest.approx(200 * w.iteration_s(32))
    # at ideal packing, training is train_share of a step's cell-time (fixed cost aside)
    specs = w.executions(0)
    rollout = sum(w.rollout_work_s(e) for e in specs)
    train = w.train_s_per_token * sum(e.tokens for e in specs)
    assert train / (train + rollout) == pytest.approx(0.3, abs=0.005)
    r = w.rollout_s_per_token
    assert (w.train_s_per_token / (w.train_s_per_token + r)) == pytest.approx(w.cost.train_share)
    assert w.train_s(1000, trainer_cells=4) == pytest.approx(w.train_s_per_token * 250)
    assert emulated_tokens_bytes(10, 16).nbytes == 160


def _tiny(**over) -> Workload:
    data = {
        "name": "tiny",
        "cells": 2,
        "steps": 2,
        "staleness": 0,
        "tasks_per_step": 1,
        "samples_per_task": 2,
        "tokens_per_execution": {"dist": "constant", "value": 4000},
        "tokens_per_call": 2000,
        "tool_output_tokens": 100,
        "tool_latency": {"dist": "constant", "value_full_batch_iterations": 10},
        "cost": {
            "decode_b_s": 0.001,
            "a_over_b": 4,
            "max_batch": 4,
            "prefill_s_per_token": 0.0005,
            "train_share": 0.5,
            "step_fixed_s": 1.0,
            "kv_bytes_per_token": 16,
            "handoff_s": 0.5,
        },
        "time_scale": 1.0,
        "seed": 0,
    }
    data.update(over)
    return Workload.from_dict(data)


def test_lower_bound_by_hand():
    w = _tiny()
    # a = 0.004, iteration_s(4) = 0.008 -> 0.002 s/token at a full batch; c = 0.0005; 2 calls of 2000
    e = w.executions(0)[0]
    assert e.calls == ((2000, 10 * 0.008), (2000, 0.0))
    assert w.rollout_work_s(e) == pytest.approx(4000 * 0.002 + 0.0005 * 100 * 2)  # 8.1
    t = 0.5 / 0.5 * (0.002 + 0.0005 * 100 / 2000)
    assert w.train_s_per_token == pytest.approx(t)
    lb = lower_bound(w)
    # per step: rollout 2 * 8.1, training t * 8000 + 1; two steps on two cells
    assert lb["total_work_s"] == pytest.approx(2 * (2 * 8.1 + t * 8000 + 1.0) / 2)
    d = 4000 * 0.005 + 0.0005 * 100 * 2 + 0.08  # alone: a + b per token, prefill, one tool latency
    assert lb["longest_execution_s"] == pytest.approx(d)
    e0 = 1.0 + max(d + t * 4000 / 2, (2 * 8.1 + t * 8000) / 2)
    assert lb["step_end_s"][0] == pytest.approx(e0)
    assert lb["critical_path_s"] == pytest.approx(2 * e0)  # on-policy: step 1 starts after update 0
    assert lb["lower_bound_s"] == pytest.approx(max(2 * e0, lb["total_work_s"]))
    # staleness 1: step 1's executions may start at once, but its gradients are taken at update
    # 0's weights: all of its training (t * 8000 on two cells) and its fixed cost follow E(0)
    assert lower_bound(w, staleness=1)["critical_path_s"] == pytest.approx(e0 + t * 8000 / 2 + 1.0)


def test_lower_bound_shipped():
    for name in ("xlong-tail", "flat"):
        w = load_workload(name)
        lb = lower_bound(w)
        longest = max(w.min_execution_s(e) for k in range(w.steps) for e in w.executions(k))
        assert lb["longest_execution_s"] == pytest.approx(longest)
        assert lb["critical_path_s"] >= longest
        assert lb["lower_bound_s"] == max(lb["critical_path_s"], lb["total_work_s"])
        assert lower_bound(w, staleness=0)["critical_path_s"] >= lb["critical_path_s"]
        assert np.all(np.diff(lb["step_end_s"]) > 0)
    assert lower_bound(load_workload("xlong-tail"))["critical_path_s"] > lower_bound(load_workload("flat"))["critical_path_s"]


# ------------------------------------------------------------------------------------ engine

COST = Cost(
    decode_b_s=0.001,
    a_over_b=16,
    max_batch=4,
    prefill_s_per_token=0.0001,
    train_share=0.3,
    step_fixed_s=1.0,
    kv_bytes_per_token=16,
    handoff_s=0.5,
)
A, B, C = 0.016, 0.001, 0.0001
SCALE = 1000.0


class FakeClock:
    """Real time that moves only when the test says so (in emulated seconds / SCALE)."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance_emulated(self, s: float) -> None:
        self.t += s / SCALE


def _engine(clock=None, cost=COST, **kw) -> EmulatedEngine:
    return EmulatedEngine(cost, time_scale=SCALE, clock=clock, quantum_s=0.001, **kw)


def _req(rid: str, context: int, tokens: int, session: str | None = None) -> GenerationRequest:
    return GenerationRequest(rid, np.array([context], np.int32), SamplingParams(max_tokens=tokens), session=session)


def _at(engine: EmulatedEngine, clock: FakeClock, emulated_s: float) -> None:
    """Move the fake clock to ``emulated_s`` after the start and let the engine catch up."""
    clock.t = 100.0 + emulated_s / SCALE
    engine.step()


def test_single_request_costs_prefill_plus_alone_decode():
    clock = FakeClock()
    e = _engine(clock)
    fut = e.submit(_req("r", 300, 1000, session="s"))
    expected = 300 * C + 1000 * (A + B)
    _at(e, clock, expected - 0.01)
    assert not fut.done() and e.stats()["live"] == 1
    _at(e, clock, expected + 5.0)
    res = fut.result(timeout=1)
    assert res.completion_ids.tolist() == [1000] and res.finish_reason == "length"
    assert res.prompt_ids.tolist() == [300] and res.engine == "emulated" and res.prefix_reused == 0
    assert res.logprobs.shape == (1,) and res.versions.tolist() == [0]
    # taken in at the fake clock's start; finished at the modelled end, not when the engine looked
    assert res.received_at == 100.0 and res.finished_at == pytest.approx(100.0 + expected / SCALE)
    st = e.stats()
    assert st["busy_s"] == pytest.approx(expected)
    assert st["clock_s"] == pytest.approx(expected + 5.0)
    assert (st["tokens_generated"], st["prefill_tokens"], st["finished"], st["live"]) == (1000, 300, 1, 0)
    # it finished 5 emulated seconds before the engine looked: the result was handed out that late
    assert st["max_resolve_lag_s"] == pytest.approx(5.0) and st["mean_resolve_lag_s"] == pytest.approx(5.0)


def test_batched_rate_and_max_batch():
    clock = FakeClock()
    e = _engine(clock, cost=dataclasses.replace(COST, prefill_s_per_token=0.0))
    futs = [e.submit(_req(f"r{i}", 10, 200)) for i in range(5)]  # max_batch 4: the fifth waits
    _at(e, clock, 1.0)
    st = e.stats()
    assert (st["live"], st["waiting"]) == (4, 1)
    batch_end = 200 * (A + 4 * B)
    assert st["tokens_generated"] == int(4 * 1.0 / (A + 4 * B))
    _at(e, clock, batch_end - 0.01)
    assert not any(f.done() for f in futs)
    _at(e, clock, batch_end + 0.01)
    assert all(f.done() for f in futs[:4]) and not futs[4].done()
    assert e.stats()["live"] == 1
    end = batch_end + 200 * (A + B)  # the fifth starts the moment a slot frees, then runs alone
    _at(e, clock, end + 0.01)
    assert futs[4].result(timeout=1).completion_ids.tolist() == [200]
    assert e.stats()["busy_s"] == pytest.approx(end)
    assert e.stats()["tokens_generated"] == 1000


def test_prefix_reuse_charges_only_new_tokens():
    clock = FakeClock()
    e = _engine(clock)
    f1 = e.submit(_req("c0", 300, 100, session="s"))
    t1 = 300 * C + 100 * (A + B)
    _at(e, clock, t1 + 1.0)
    assert f1.result(timeout=1).prefix_reused == 0
    f2 = e.submit(_req("c1", 300 + 100 + 200, 100, session="s"))  # tool output of 200 new tokens
    f3 = e.submit(_req("d0", 50, 100, session="other"))
    _at(e, clock, t1 + 1.0 + 1000.0)
    r2 = f2.result(timeout=1)
    assert r2.prefix_reused == 400 and f3.result(timeout=1).prefix_reused == 0
    st = e.stats()
    assert st["prefill_tokens"] == 300 + 200 + 50 and st["reused_tokens"] == 400
    assert st["busy_s"] == pytest.approx(t1 + (200 + 50) * C + 100 * (A + 2 * B))


def test_export_midway_and_import_elsewhere():
    clock1, clock2 = FakeClock(), FakeClock()
    e1, e2 = _engine(clock1, name="cell-1"), _engine(clock2, name="cell-2")
    fut = e1.submit(_req("r", 500, 1000, session="s"))
    waiting = [e1.submit(_req(f"w{i}", 10, 10**6)) for i in range(4)]  # the last one cannot be admitted
    _at(e1, clock1, 500 * C + 10 * C * 3 + 10.0)  # after the prefills, 10 s of decode at a batch of 4
    assert e1.stats()["waiting"] == 1
    state = e1.export_request("r")
    with pytest.raises(RequestExported):
        fut.result(timeout=1)
    done = int(state.completion_ids[0])
    assert abs(done - 10.0 / (A + 4 * B)) <= 1
    assert state.prompt_ids.tolist() == [500] and state.source == "cell-1" and state.session == "s"
    assert state.kv.dtype == np.uint8 and state.kv.nbytes == (500 + done) * 16
    assert state.generator_state.size == 0 and state.versions.shape == (1,)
    assert sorted(e1.request_ids()) == ["w0", "w1", "w2", "w3"]
    with pytest.raises(KeyError):
        e1.export_request("r")
    # a waiting request leaves with no KV
    w_state = e1.export_request("w3")
    assert w_state.kv.nbytes == 0 and w_state.completion_ids.tolist() == [0]
    with pytest.raises(RequestExported):
        waiting[3].result(timeout=1)

    fut2 = e2.import_request(state)
    _at(e2, clock2, 0.4)  # the hand-off (0.5 s) delays the request, not the cell
    assert e2.stats()["arriving"] == 1 and e2.stats()["busy_s"] == 0.0
    end = 0.5 + (1000 - done) * (A + B)
    _at(e2, clock2, end - 0.01)
    assert not fut2.done()
    _at(e2, clock2, end + 0.01)
    res = fut2.result(timeout=1)
    assert res.completion_ids.tolist() == [1000] and res.engine == "cell-2"
    assert res.received_at is None and res.finished_at == pytest.approx(100.0 + end / SCALE)
    st = e2.stats()
    assert st["prefill_tokens"] == 0 and st["imported"] == 1 and st["tokens_generated"] == 1000 - done
    assert st["busy_s"] == pytest.approx((1000 - done) * (A + B))
    assert e1.stats()["exported"] == 2
    # the session's cache moved: its next call prefills only the new tokens on cell-2
    f3 = e2.submit(_req("r-next", 1500 + 100, 10, session="s"))
    _at(e2, clock2, end + 10.0)
    assert f3.result(timeout=1).prefix_reused == 1500
    # and the waiting request, imported elsewhere, prefills its whole prompt there
    f4 = e2.import_request(w_state)
    _at(e2, clock2, end + 20.0)
    assert not f4.done() and e2.stats()["live"] == 1
    assert e2.stats()["prefill_tokens"] == 100 + 10


def test_weights_version_appears_in_results():
    clock = FakeClock()
    e = _engine(clock, version=2)
    fut = e.submit(_req("r", 10, 100))
    _at(e, clock, 0.5)
    e.load_weights({"ignored": np.zeros(3)}, 3)
    assert e.has_work() and e.version == 2
    _at(e, clock, 0.6)
    assert e.version == 3 and e.stats()["staged_version"] is None
    _at(e, clock, 100.0)
    assert fut.result(timeout=1).versions.tolist() == [3]


def test_bad_requests():
    e = _engine(FakeClock())
    with pytest.raises(ValueError, match="context_tokens"):
        e.submit(GenerationRequest("x", np.array([1, 2, 3], np.int32), SamplingParams(max_tokens=5)))
    with pytest.raises(ValueError, match="max_tokens"):
        e.submit(_req("y", 5, 0))
    e.submit(_req("z", 5, 5))
    with pytest.raises(ValueError, match="already"):
        e.submit(_req("z", 5, 5))


def test_runs_under_engine_runner_real_clock():
    w = load_workload("xlong-tail")
    e1 = EmulatedEngine(w, time_scale=100_000.0, name="a")
    with EngineRunner(e1, idle_timeout=0.1):
        futs: list = []
        lock = threading.Lock()

        def client(k: int) -> None:
            for i in range(5):
                f = e1.submit(_req(f"c{k}-{i}", 300 + 50 * i, 100 + i, session=f"s{k}"))
                with lock:
                    futs.append(f)
                f.result(timeout=20)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert len(futs) == 30 and all(f.result(timeout=1).completion_ids[0] >= 100 for f in futs)
    st = e1.stats()
    assert st["finished"] == 30 and st["live"] == 0 and st["reused_tokens"] > 0
    assert 0 < st["busy_s"] <= st["clock_s"]

    # a long generation moves between two running engines and completes there
    e2 = EmulatedEngine(w, time_scale=200.0, name="b")
    e3 = EmulatedEngine(w, time_scale=200.0, name="c")
    with EngineRunner(e2, idle_timeout=0.1) as r2, EngineRunner(e3, idle_timeout=0.1) as r3:
        fut = r2.submit(_req("long", 300, 20000, session="x"))  # ~170 emulated s alone: ~0.85 s real
        deadline = time.monotonic() + 10
        while e2.stats()["tokens_generated"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        state = r2.export_request("long")
        assert 0 < int(state.completion_ids[0]) < 20000
        fut3 = r3.import_request(state)
        e3.load_weights(None, 7)
        res = fut3.result(timeout=30)
        assert res.completion_ids.tolist() == [20000] and res.engine == "c" and res.versions.tolist() == [7]
        with pytest.raises(RequestExported):
            fut.result(timeout=1)


def test_engine_factory_for_the_service():
    e = emulated_engine_factory({}, {}, 4, "tcp://cell:1", workload="flat")
    assert (e.name, e.version, e.time_scale, e.max_batch) == ("tcp://cell:1", 4, 100.0, 32)
    e2 = emulated_engine_factory(None, None, 0, "x", workload=COST, time_scale=50.0)
    assert e2.cost == COST and e2.time_scale == 50.0 and e2.request_ids() == []


def test_messaging_time_of_a_call_by_hand():
    def result(received_at, finished_at):
        return GenerationResult("r", np.array([5], np.int32), np.array([3], np.int32), np.zeros(1, np.float32),
                                np.zeros(1, np.int32), "length", received_at=received_at, finished_at=finished_at)

    # sent at 10.0, taken in at 10.25, finished at 12.0, back at 12.5: 0.25 there, 0.5 back
    assert messaging_s(10.0, result(10.25, 12.0), 12.5, rerouted=False) == pytest.approx(0.75)
    # a re-routed call's way there is unknown (it includes the engines that sent it back), as is a migrated one's
    assert messaging_s(10.0, result(10.25, 12.0), 12.5, rerouted=True) == pytest.approx(0.5)
    assert messaging_s(10.0, result(None, 12.0), 12.5, rerouted=False) == pytest.approx(0.5)
    # an engine that does not stamp its results; clocks a hair apart never give negative time
    assert messaging_s(10.0, result(None, None), 12.5, rerouted=False) == 0.0
    assert messaging_s(10.0, result(9.999, 12.501), 12.5, rerouted=False) == 0.0
