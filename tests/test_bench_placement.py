"""`gyreflow bench placement` end to end on a tiny workload: the three modes really run the same
executions on a real cluster and report the figures the issue asks for (never their speed)."""

import json
import subprocess
import sys

import pytest

from gyreflow.bench import load_workload

TINY = {
    "name": "tiny",
    "description": "A few short executions, for tests.",
    "cells": 3,
    "steps": 2,
    "staleness": 1,
    "tasks_per_step": 3,
    "samples_per_task": 2,
    "tokens_per_execution": {"dist": "uniform", "low": 2000, "high": 6000},
    "tokens_per_call": 1000,
    "tool_output_tokens": 100,
    "tool_latency": {"dist": "lognormal", "median_full_batch_iterations": 20, "sigma": 1.0},
    "cost": {"decode_b_s": 0.0005, "a_over_b": 16, "max_batch": 4, "prefill_s_per_token": 0.0001,
             "train_share": 0.3, "step_fixed_s": 5.0, "kv_bytes_per_token": 16, "handoff_s": 0.5},
    "time_scale": 100.0,
    "seed": 3,
}


def test_every_mode_side_by_side(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, "-m", "gyreflow.cli", "bench", "placement", "--workload", str(path),
                        "--json", str(out)], capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    fig = json.loads(out.read_text())
    assert fig["workload"] == "tiny" and set(fig["modes"]) == {"colocated", "async_user", "async_oracle", "lend", "elastic"}
    assert fig["git"] and fig["workload_spec"]["name"] == "tiny" and fig["repeats"] == 1
    n = TINY["steps"] * TINY["tasks_per_step"] * TINY["samples_per_task"]
    tokens = sum(e.tokens for s in range(TINY["steps"]) for e in load_workload(str(path)).executions(s))
    for name, m in fig["modes"].items():
        for key in ("wall_s", "emulated_s", "utilization", "moves", "migrations"):
            assert set(m[key]) == {"mean", "min", "max"}, (name, key)
        # Same executions in every mode, each run exactly once.
        assert m["executions"] == m["unique_executions"] == n, name
        assert m["tokens"] == tokens, name
        assert 0 < m["utilization"]["mean"] <= 1.0 + 1e-6, name
    for run in fig["runs"]:
        assert run["emulated_s"] == run["wall_s"] * TINY["time_scale"]
        assert run["stalls"] == [] and run["moves_failed"] == 0
        # Each step's longest execution: no schedule runs it faster than alone on a cell.
        assert [x["step"] for x in run["longest"]] == list(range(TINY["steps"]))
        assert all(x["took_s"] >= 0.99 * x["alone_s"] > 0 for x in run["longest"]), run["longest"]
    assert fig["modes"]["colocated"]["max_staleness"] == 0
    assert fig["modes"]["async_user"]["max_staleness"] <= 1 and fig["modes"]["elastic"]["max_staleness"] <= 1
    assert fig["modes"]["async_user"]["moves"]["max"] == 0
    assert fig["modes"]["colocated"]["moves"]["min"] > 0  # every cell trains, then rolls out again
    # The user's split comes from colocated's first step, the oracle's from the splits tried.
    first = fig["first_step"]
    share = first["train_s"] / (first["rollout_s"] + first["train_s"])
    trainer = min(2, max(1, round(3 * share)))
    assert fig["modes"]["async_user"]["split"] == f"{3 - trainer}:{trainer}"
    assert fig["oracle_split"] == "2:1" and set(fig["oracle_splits"]) == {"2:1"}  # 1 to cells // 2 trainer cells
    assert set(fig["ratios"]) == {"elastic_vs_async_user", "elastic_vs_async_oracle", "elastic_vs_colocated",
                                  "elastic_vs_lend", "elastic_vs_lower_bound", "elastic_vs_batched_bound"}
    e = fig["modes"]["elastic"]["emulated_s"]["mean"]
    assert fig["ratios"]["elastic_vs_lower_bound"]["mean"] == pytest.approx(e / fig["lower_bound_s"])
    assert fig["ratios"]["elastic_vs_colocated"]["mean"] == pytest.approx(fig["modes"]["colocated"]["emulated_s"]["mean"] / e)
    assert 0 < fig["lower_bound_s"] <= fig["batched_bound_s"]
    assert "elastic_vs_async_user" in p.stdout and "lower bound" in p.stdout


# On-policy, no batching gain (a = 0: decode time is linear in the batch), constant executions of
# one call each, training half the work. Per step, with R = T = 6 * 40,000 * b = 120 cell-s of
# rollout and of training and F = 1 s: colocated takes R/3 + T/3 + F = 81 s; a fixed split r:t
# takes R/r + T/t + F, 181 s at 2:1 as at 1:2. Colocated is the best mode, by 181/81 = 2.23x.
CRAFTED = {
    "name": "crafted", "description": "known answer: colocated is best",
    "cells": 3, "steps": 1, "staleness": 0, "tasks_per_step": 3, "samples_per_task": 2,
    "tokens_per_execution": {"dist": "constant", "value": 40000}, "tokens_per_call": 40000, "tool_output_tokens": 1,
    "tool_latency": {"dist": "constant", "value_full_batch_iterations": 1},
    "cost": {"decode_b_s": 0.0005, "a_over_b": 0, "max_batch": 8, "prefill_s_per_token": 0.0,
             "train_share": 0.5, "step_fixed_s": 1.0, "kv_bytes_per_token": 16, "handoff_s": 0.0},
    # Slow enough that the wall seconds a busy machine adds (cell moves, task hand-offs) stay small
    # next to the modelled ones: they only ever add, so the checks below are one-sided beyond 3%.
    "time_scale": 20.0, "seed": 0,
}


def test_a_workload_with_a_known_best_mode_gets_it():
    from gyreflow.bench.placement import run_bench
    from gyreflow.bench.workload import Workload

    # (The oracle's only split here, 2:1, is the user's mirror image: run in the test above.)
    out = run_bench(Workload.from_dict(CRAFTED), arms=("colocated", "async_user"), log=lambda *_: None)
    m = {arm: v["emulated_s"]["mean"] for arm, v in out["modes"].items()}
    assert min(m, key=m.get) == "colocated"
    assert 81 * 0.97 <= m["colocated"] <= 81 * 1.3
    assert out["modes"]["async_user"]["split"] == "1:2"  # the first step's work: half rollout, half training
    assert 181 * 0.97 <= m["async_user"] <= 181 * 1.3
    # With a = 0 an execution among k on its cell takes k times as long as alone: colocated runs
    # the 6 executions 2 to a cell, 1:2 all 6 on its one rollout cell.
    stretch = {arm: v["longest_stretch"]["mean"] for arm, v in out["modes"].items()}
    assert 2 * 0.97 <= stretch["colocated"] <= 2 * 1.3
    assert 6 * 0.97 <= stretch["async_user"] <= 6 * 1.3
    # The bounds are those of the colocated schedule, which no placement can beat here.
    assert out["lower_bound_s"] == pytest.approx(81, rel=0.01)


def _with(**over):
    from gyreflow.bench.workload_file import workload_from_dict

    return workload_from_dict({**TINY, **over}, source="w.json")


def test_arms_a_cluster_shape_or_timeline_would_stall_are_refused_before_any_run():
    from gyreflow.bench.placement import arm_problem, run_bench
    from gyreflow.bench.workload import WorkloadError

    w = _with(cells=4, timeline=[{"at": 50, "join": 2}, {"at": 100, "leave": ["cell-3"]}])
    # At 3:1 cell-3 is the only trainer, and both joiners of a 3:1 split roll out (a quarter of two
    # joiners rounds to none): its leaving takes the last trainer.
    assert "takes the last trainer cell" in arm_problem(w, "async", (3, 1))
    assert "takes the last trainer cell" in arm_problem(w, "lend", (3, 1))
    assert arm_problem(w, "async", (2, 2)) is None  # cell-2 still trains
    assert arm_problem(w, "elastic", (3, 1)) is None and arm_problem(w, "colocated", (4, 0)) is None
    # Elastic refills a pool, but needs a cell for each.
    w1 = _with(cells=3, timeline=[{"at": 50, "leave": ["cell-0", "cell-1"]}])
    assert "leaves 1 cell(s); placement 'elastic' needs 2" in arm_problem(w1, "elastic", (2, 1))
    assert arm_problem(w1, "colocated", (3, 0)) is None
    # The benchmark refuses before it starts a cluster (this returns at once, no run is made).
    with pytest.raises(WorkloadError, match="arm 'async_oracle' at 3:1 cannot run: timeline\\[1\\]"):
        run_bench(w, arms=("async_oracle",), splits=[(3, 1)], log=lambda *a: None)
    with pytest.raises(WorkloadError, match="arm 'elastic' at 1:1 cannot run: placement 'elastic' cannot move a cell"):
        run_bench(_with(cells=2), arms=("colocated", "elastic"), log=lambda *a: None)
    with pytest.raises(WorkloadError, match="arm 'async_user' at 1:0 cannot run: .*trainer cell"):
        run_bench(_with(cells=1), arms=("async_user",), log=lambda *a: None)
    with pytest.raises(WorkloadError, match="field 'timeline' gives the run 1003 cells; the benchmark runs at most 64"):
        run_bench(_with(timeline=[{"at": 5, "join": 1000}]), arms=("elastic",), log=lambda *a: None)
