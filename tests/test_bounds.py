"""The batching-aware bound (:func:`gyreflow.bench.bounds.batched_bound`) against values found
independently: closed forms worked by hand, and a brute-force search of the relaxation on tiny
workloads."""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest

from gyreflow.bench import Workload, load_workload
from gyreflow.bench.bounds import batched_bound, lower_bound

BASE = {
    "name": "tiny",
    "description": "test workload",
    "cells": 4,
    "steps": 1,
    "staleness": 0,
    "tasks_per_step": 8,
    "samples_per_task": 8,
    "tokens_per_execution": {"dist": "constant", "value": 10},
    "tokens_per_call": 1000,
    "tool_output_tokens": 0,
    "tool_latency": {"dist": "constant", "value_full_batch_iterations": 1},
    "cost": {"decode_b_s": 1.0, "a_over_b": 16, "max_batch": 32, "prefill_s_per_token": 0.0, "train_share": 0.0,
             "step_fixed_s": 0.0, "kv_bytes_per_token": 1, "handoff_s": 0.0},
    "time_scale": 1.0,
    "seed": 0,
}


def make(cost: dict | None = None, **fields) -> Workload:
    d = copy.deepcopy(BASE)
    d.update(fields)
    d["cost"].update(cost or {})
    return Workload.from_dict(d)


# ------------------------------------------------------------------------------------ by hand


@pytest.mark.parametrize(("cells", "expected", "loose"), [(4, 320.0, 240.0), (8, 240.0, 170.0), (100, 170.0, 170.0)])
def test_one_step_closed_form(cells, expected, loose):
    # 64 executions of 10 tokens in one call (no tool latency, prefill, training or F): a = 16,
    # b = 1, B = 32. The window is X = M. At batch k an execution takes 10*(16 + k) and costs
    # 10*(16/k + 1) cell-seconds, so k = X/10 - 16 and, with y = X - 160 = 10k, the cell time is
    # 64*(10 + 1600/y) = 640 + 102400/y, which must fit C*(y + 160):
    #   C = 4:   4y^2 = 102400                 -> y = 160, M = 320 (k = 16)
    #   C = 8:   y^2 + 80y - 12800 = 0          -> y = 80,  M = 240 (k = 8)
    #   C = 100: capacity never binds (64*170 <= 100*170): M = 10*17 = 170, each alone (k = 1).
    # The loose bound: full-batch work 64*10*1.5 = 960 over C cells, or 170 alone.
    w = make(cells=cells)
    out = batched_bound(w)
    assert out["lower_bound_s"] == pytest.approx(loose, rel=1e-12)
    assert out["batched_bound_s"] == pytest.approx(expected, rel=1e-6)
    assert out["batched_bound_s"] <= expected * (1 + 1e-12)  # a lower bound, never above the optimum
    assert out["upper_s"] == pytest.approx(expected, rel=1e-4)


def test_two_steps_fixed_cost_closed_form():
    # Two steps as above on C = 8 cells, staleness 0, F = 64: X_k = g_k - F, M = g_0 + g_1.
    # Without the per-step capacity the optimum is symmetric (convex, symmetric): X = M/2 - 64 and
    # 2*(640 + 102400/y) + 2F = 8*(2X + 2F) with y = X - 160:
    #   16y^2 + (1280 + 14*64)y - 204800 = 0 -> 16*4096 + 2176*64 = 65536 + 139264 = 204800 ok,
    #   y = 64, X = 224, M = 2*(224 + 64) = 576.
    # Each step's own work must also fit its window on 8 cells: 8X >= 640 + 102400/y -> y >= 80
    # (as for C = 8 above), X >= 240, M = 2*(240 + 64) = 608; then the total 2*(640 + 1280) + 128 =
    # 3968 fits 8*608 = 4864.
    # Loose: E(0) = 64 + 170 = 234, E(1) = 234 + 64 + 170 = 468; work (2*960 + 128)/8 = 256.
    w = make(cells=8, steps=2, cost={"step_fixed_s": 64.0})
    tight = batched_bound(w)
    plain = batched_bound(w, step_capacity=False)
    assert tight["lower_bound_s"] == pytest.approx(468.0, rel=1e-12)
    assert tight["batched_bound_s"] == pytest.approx(608.0, rel=1e-6)
    assert plain["batched_bound_s"] == pytest.approx(576.0, rel=1e-6)
    assert tight["batched_bound_s"] <= 608.0 * (1 + 1e-12) and plain["batched_bound_s"] <= 576.0 * (1 + 1e-12)
    assert tight["windows_s"] == pytest.approx([240.0, 240.0], rel=1e-3)
    assert plain["windows_s"] == pytest.approx([224.0, 224.0], rel=1e-3)


def test_training_waits_for_the_previous_update():
    # Two steps at staleness 1 on 32 cells, F = 0: both steps' executions start at 0. Each step:
    # 64 executions of 10 tokens in one call, a = 16, b = 1, B = 32, so r = (16 + 32)/32 = 1.5 s
    # per token and, at train_share 0.5, t = 1.5: 960 cell-s of training a step, 30 s on 32 cells.
    # An execution alone takes 10*17 = 170 s, then its gradients 15/32 s: E(0) = 170.46875.
    # Step 1's gradients are taken at update 0's weights, so E(1) >= E(0) + 30 = 200.46875 (its
    # executions alone would allow 170.46875 again). All the work: 2*(960 + 960)/32 = 120 s.
    w = make(cells=32, steps=2, staleness=1, cost={"train_share": 0.5})
    loose = lower_bound(w)
    assert loose["step_end_s"] == pytest.approx([170.46875, 200.46875], rel=1e-12)
    assert loose["lower_bound_s"] == pytest.approx(200.46875, rel=1e-12)
    assert batched_bound(w)["batched_bound_s"] >= 200.46875 * (1 - 1e-9)


# ------------------------------------------------------------------------------------ brute force


def relaxation_optimum(w: Workload, step_capacity: bool) -> float:
    """The relaxation's least makespan by search: a fine absolute grid of the first gap and, over
    it, bisection on M (every M it reports is feasible, so it is at or above the optimum)."""
    a, b, B, c, F = w.a, w.b, w.cost.max_batch, w.c, w.cost.step_fixed_s
    C, s, K = w.cells, w.staleness, w.steps
    steps = []
    for k in range(K):
        t = w.at(k).train_s_per_token
        ex = w.executions(k)
        tok = np.array([e.tokens for e in ex], float)
        pre = np.array([c * e.new_prompt_tokens * e.num_calls for e in ex])
        other = np.array([e.tool_latency_s for e in ex]) + pre + t * tok / C
        steps.append((tok, other, pre.sum(), t * tok.sum()))

    def cell_time(k: int, x: np.ndarray) -> np.ndarray:
        """Least cell-seconds of step k's rollouts in windows x (inf where one cannot finish)."""
        tok, other, pre, _ = steps[k]
        total = np.full(x.shape, pre)
        for n, o in zip(tok, other):
            tau = (x - o) / n  # the slowest per-token time that still ends in the window
            kb = np.minimum(B, (tau - a) / b)  # the batch that per-token time allows
            total = total + np.where(kb >= 1, n * (a / np.maximum(kb, 1) + b), np.inf)
        return total

    train = sum(tr for *_, tr in steps) + K * F

    # Step k's training follows update k-1: each gap is at least F plus that training on C cells.
    floor = [F + tr / C for *_, tr in steps]

    def feasible(m: float, g0: np.ndarray) -> bool:
        if K == 1:
            if m < floor[0]:
                return False
            xs = [np.array([m - F])]
        else:
            g0 = g0[(g0 >= floor[0]) & (g0 <= m - floor[1])]
            if g0.size == 0:
                return False
            xs = [g0 - F, (m - g0 - F) if s == 0 else np.full(g0.shape, m - F)]
        ok = np.ones(xs[0].shape, bool)
        work = np.zeros(xs[0].shape)
        for k, x in enumerate(xs):
            wk = cell_time(k, x)
            ok &= np.isfinite(wk)
            if step_capacity:
                ok &= wk + steps[k][3] <= C * x
            work = work + wk
        ok &= work + train <= C * m
        return bool(ok.any())

    hi = 1.0
    g0 = None
    while True:
        g0 = np.linspace(0.0, hi, 40001)
        if feasible(hi, g0):
            break
        hi *= 2
    lo = 0.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if feasible(mid, g0) else (mid, hi)
    return hi


def tiny(seed: int) -> Workload:
    r = np.random.default_rng(seed)
    steps = int(r.integers(1, 3))
    tasks, samples = [(1, 1), (1, 2), (2, 1), (1, 3), (3, 1)][int(r.integers(0, 5))]
    low = int(r.integers(3, 20))
    return make(
        cells=int(r.integers(1, 3)),
        steps=steps,
        staleness=int(r.integers(0, 3)),
        tasks_per_step=tasks,
        samples_per_task=samples,
        tokens_per_execution={"dist": "uniform", "low": low, "high": low + int(r.integers(0, 30))},
        tokens_per_call=int(r.choice([4, 7, 100])),
        tool_output_tokens=int(r.choice([0, 3])),
        tool_latency={"dist": "constant", "value_full_batch_iterations": float(r.choice([0.5, 2.0]))},
        seed=seed,
        cost={"decode_b_s": float(r.choice([0.5, 1.0])),
              "a_over_b": float(r.choice([0, 2, 8, 16], p=[0.1, 0.3, 0.3, 0.3])),
              "max_batch": int(r.choice([1, 2, 4, 8], p=[0.1, 0.3, 0.3, 0.3])),
              "prefill_s_per_token": float(r.choice([0.0, 0.1])),
              "train_share": float(r.choice([0.0, 0.3])), "step_fixed_s": float(r.choice([0.0, 5.0]))},
    )


@pytest.mark.parametrize("seed", range(24))
def test_valid_and_tight_against_brute_force(seed):
    w = tiny(seed)
    loose = lower_bound(w)["lower_bound_s"]
    for step_capacity in (True, False):
        out = batched_bound(w, step_capacity=step_capacity)
        opt = relaxation_optimum(w, step_capacity)
        # Without the per-step capacity the relaxation can sit below the loose bound (its
        # per-step work term); the result is the larger of the two either way.
        target = opt if step_capacity else max(opt, loose)
        assert out["batched_bound_s"] >= loose
        assert out["batched_bound_s"] <= target * (1 + 1e-9), (seed, step_capacity, out, opt)
        assert out["batched_bound_s"] >= target * (1 - 1e-3), (seed, step_capacity, out, opt)
        if step_capacity:
            assert opt >= loose * (1 - 1e-9)  # the loose bound's terms are all in this relaxation


# ------------------------------------------------------------------------------------ sanity


def test_more_cells_never_raise_the_bound():
    w = load_workload("xlong-tail")
    previous = None
    for cells in (4, 6, 8, 12, 16):
        out = batched_bound(w, cells=cells)
        assert out["lower_bound_s"] <= out["batched_bound_s"] <= out["upper_s"]
        if previous is not None:
            # Exact: a relaxation feasible with fewer cells is feasible with more.
            assert out["batched_bound_s"] <= previous["upper_s"]
            assert out["batched_bound_s"] <= previous["batched_bound_s"] * (1 + 1e-6)
        previous = out
    for seed in range(6):
        w = tiny(100 + seed)
        values = [batched_bound(w, cells=c)["batched_bound_s"] for c in (1, 2, 3, 5)]
        assert all(y <= x * (1 + 1e-6) for x, y in zip(values, values[1:])), values


def test_cell_timeline_between_its_extremes():
    # 2 cells, 2 more from t = 100: the timeline's relaxation is looser than 2 cells throughout and
    # tighter than 4 throughout.
    w = make(cells=2, steps=2, staleness=1, timeline=[{"at": 100, "join": 2}],
             tokens_per_execution={"dist": "uniform", "low": 5, "high": 40}, cost={"step_fixed_s": 5.0})
    timeline = batched_bound(w)
    two, four = batched_bound(w, cells=2), batched_bound(w, cells=4)
    assert timeline["cells"] == 4
    assert timeline["batched_bound_s"] <= two["upper_s"]
    assert timeline["batched_bound_s"] >= four["batched_bound_s"] * (1 - 1e-6)
    assert timeline["batched_bound_s"] >= timeline["lower_bound_s"]


@pytest.mark.parametrize("name", ["xlong-tail", "flat"])
def test_shipped_workloads(name):
    w = load_workload(name)
    t0 = time.perf_counter()
    loose = lower_bound(w)
    t1 = time.perf_counter()
    out = batched_bound(w)
    t2 = time.perf_counter()
    print(f"{name}: lower_bound {loose['lower_bound_s']:.1f} s ({t1 - t0:.2f} s), "
          f"batched_bound {out['batched_bound_s']:.1f} s ({t2 - t1:.2f} s), upper {out['upper_s']}")
    assert out["lower_bound_s"] == loose["lower_bound_s"]
    assert out["batched_bound_s"] >= loose["lower_bound_s"]
    assert out["upper_s"] is not None and out["batched_bound_s"] <= out["upper_s"]
    assert len(out["windows_s"]) == len(out["step_end_s"]) == w.steps
    assert all(x >= m * (1 - 1e-12) for x, m in zip(out["windows_s"], out["min_windows_s"]))
    assert out["step_end_s"][-1] == pytest.approx(out["upper_s"], rel=1e-9)
    assert all(1.0 <= k <= w.cost.max_batch for k in out["mean_batch"])
