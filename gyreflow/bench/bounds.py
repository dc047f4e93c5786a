"""Lower bounds on the emulated wall time of any schedule of a workload (what placement is measured
against).

:func:`lower_bound` is the loose bound, :func:`batched_bound` the one that respects batching.
"""

from __future__ import annotations

import numpy as np

from gyreflow.bench.workload import Workload


def lower_bound(workload: Workload, *, staleness: int | None = None, cells: int | None = None) -> dict:
    """A lower bound on the emulated wall time of any schedule of ``workload``.

    ``lower_bound_s = max(total_work_s, critical_path_s)``; neither term can be beaten by a perfect
    scheduler with free, instant migration.

    total_work_s
        All cell work divided by the cells. Rollout work of an execution at its cheapest (full
        batches, every prefix cached): ``tokens * iteration_s(max_batch)/max_batch`` plus
        ``c * new_prompt_tokens`` per call. Training per step: ``t * tokens_of_step`` plus
        ``step_fixed_s`` (the fixed cost counted once per step, on one cell). With a cell timeline,
        the earliest time by which that many cell-seconds exist.
    critical_path_s
        The end ``E(steps-1)`` of the last update under the dependencies. With staleness ``s``,
        ``F = step_fixed_s``, ``C = cells``, ``D_i`` the shortest duration of execution ``i`` (alone on
        a cell: per call ``c * new tokens + tokens * iteration_s(1)``, plus its tool latencies,
        :meth:`Workload.min_execution_s`), ``tok_i`` its tokens, ``W_k`` step k's rollout work and
        ``T_k`` its tokens::

            S(k) = E(k-1-s) if k-1-s >= 0 else 0      # step k's executions start no earlier
            E(k) = F + max( E(k-1) + t*T_k/C            # step k's gradients are taken at update
                                                        # k-1's weights (E(-1) = 0)
                          , S(k) + max_i (D_i + t*tok_i/C)   # an execution, then its gradients on
                                                              # every cell at once
                          , S(k) + (W_k + t*T_k)/C )     # all of step k's work, on every cell

        Each term is a necessary condition: the optimizer's ``F`` follows every gradient of its step,
        every gradient of step k follows update k-1 (it is computed at the weights that update
        makes) and its execution's end, and nothing of step k starts before ``S(k)``. Work of other steps running meanwhile is ignored (which only
        loosens the bound). Each step's own figures (``t``, its executions) are those of its
        schedule; with a cell timeline, ``C`` is the most cells the run ever has.

    Parameters
    ----------
    staleness
        Defaults to the workload's; ``colocated`` runs on-policy (0).
    cells
        Defaults to the workload's (its timeline); a number means that many cells throughout.

    Returns
    -------
    dict
        ``lower_bound_s``, ``critical_path_s``, ``total_work_s``, ``rollout_work_s`` and
        ``train_work_s`` (cell-seconds, all steps), ``longest_execution_s`` (shortest possible
        duration of the longest execution), ``step_end_s`` (``E(k)`` per step), ``staleness``,
        ``cells``.
    """
    s = workload.staleness if staleness is None else int(staleness)
    n_cells = max(n for _, n in workload.cells_over_time()) if cells is None else int(cells)
    if s < 0 or n_cells < 1:
        raise ValueError("staleness must be >= 0 and cells >= 1")
    fixed = workload.cost.step_fixed_s
    ends: list[float] = []
    rollout_total = train_total = 0.0
    longest = 0.0
    for k in range(workload.steps):
        t = workload.at(k).train_s_per_token
        specs = workload.executions(k)
        dur = np.array([workload.min_execution_s(e) for e in specs])
        tok = np.array([e.tokens for e in specs], dtype=np.float64)
        work = float(sum(workload.rollout_work_s(e) for e in specs))
        tokens_k = float(tok.sum())
        rollout_total += work
        train_total += t * tokens_k + fixed
        longest = max(longest, float(dur.max()))
        start = ends[k - 1 - s] if k - 1 - s >= 0 else 0.0
        prev = ends[k - 1] if k >= 1 else 0.0
        ends.append(
            fixed
            + max(
                prev + t * tokens_k / n_cells,
                start + float(np.max(dur + t * tok / n_cells)),
                start + (work + t * tokens_k) / n_cells,
            )
        )
    work_all = rollout_total + train_total
    total_work = work_all / n_cells if cells is not None else workload.time_for(work_all)
    critical = ends[-1]
    return {
        "lower_bound_s": max(total_work, critical),
        "critical_path_s": critical,
        "total_work_s": total_work,
        "rollout_work_s": rollout_total,
        "train_work_s": train_total,
        "longest_execution_s": longest,
        "step_end_s": ends,
        "staleness": s,
        "cells": n_cells,
    }


# ---------------------------------------------------------------------------------------- batched


class _Decode:
    """Step-wise decode cell time of a workload's executions, given each step's window.

    Execution ``i`` of step ``k`` decodes ``tok_i`` tokens within ``X_k - o_i``; with
    ``u = X_k - o_i - a*tok_i`` its batch is at most ``min(B, u/(b*tok_i))`` and its decode costs at
    least ``w_i = tok_i*b + a*b*tok_i**2/u`` cell-seconds, ``tok_i*(a/B + b)`` once ``u >= b*B*tok_i``.
    """

    def __init__(self, step: np.ndarray, tok: np.ndarray, o: np.ndarray, prefill: np.ndarray, a: float, b: float,
                 batch: int) -> None:
        self.step, self.tok, self.o, self.prefill = step, tok, o, prefill
        self.a, self.b, self.batch = a, b, batch
        self.steps = len(prefill)
        self.full = tok * (a / batch + b)
        self.sat_u = b * batch * tok
        self.x_exec = self._max(o + tok * (a + b))  # k = 1: the shortest window
        self.x_sat = self._max(o + tok * (a + b * batch))  # k = B: every execution at a full batch

    def _max(self, v: np.ndarray) -> np.ndarray:
        out = np.full(self.steps, -np.inf)
        np.maximum.at(out, self.step, v)
        return out

    def _sum(self, v: np.ndarray) -> np.ndarray:
        return np.bincount(self.step, weights=v, minlength=self.steps)

    def __call__(self, x: np.ndarray, order: int = 0) -> tuple[np.ndarray, ...]:
        """``W_k(X_k)`` (prefill included) and, up to ``order``, its right derivatives in ``X_k``."""
        u = x[self.step] - self.o - self.a * self.tok
        sat = u >= self.sat_u
        u = np.where(sat, self.sat_u, u)
        ab2 = self.a * self.b * self.tok**2
        out = [self._sum(np.where(sat, self.full, self.tok * self.b + ab2 / u)) + self.prefill]
        if order >= 1:
            out.append(self._sum(np.where(sat, 0.0, -ab2 / u**2)))
        if order >= 2:
            out.append(self._sum(np.where(sat, 0.0, 2.0 * ab2 / u**3)))
        return tuple(out)

    def mean_batch(self, x: np.ndarray) -> np.ndarray:
        """Per step, the token-weighted harmonic mean of the largest batches the windows allow."""
        u = x[self.step] - self.o - self.a * self.tok
        k = np.clip(u / (self.b * self.tok), 1.0, self.batch)
        return self._sum(self.tok) / self._sum(self.tok / k)

    def min_plus_linear(self, mu: np.ndarray, xmin: np.ndarray) -> np.ndarray:
        """A lower bound (to rounding) on ``min_{X >= xmin_k} W_k(X) + mu_k*X`` per step ``k``.

        Safeguarded Newton on the (increasing) right derivative keeps ``phi'(lo) < 0 <= phi'(hi)``;
        the minimum then lies in ``[lo, hi]`` and is at least ``phi(lo) + phi'(lo)*(hi - lo)``.
        """
        lo = xmin.astype(np.float64).copy()
        hi = np.maximum(self.x_sat, lo)
        f_lo, d_lo, dd_lo = self(lo, 2)
        d_lo = d_lo + mu
        done = d_lo >= 0.0
        for i in range(200):
            slack = np.where(done, 0.0, -d_lo * (hi - lo))
            if np.all(slack <= 1e-14 * np.abs(f_lo + mu * lo)) or np.all(done | (hi - lo <= 4e-16 * np.abs(hi))):
                break
            newton = lo - d_lo / np.where(dd_lo > 0.0, dd_lo, np.inf)
            mid = np.where((i % 3 == 2) | ~(newton > lo) | ~(newton < hi), 0.5 * (lo + hi), newton)
            mid = np.where(done, lo, mid)
            f_mid, d_mid, dd_mid = self(mid, 2)
            neg = (d_mid + mu < 0.0) & ~done
            lo, f_lo, d_lo, dd_lo = (np.where(neg, mid, lo), np.where(neg, f_mid, f_lo),
                                     np.where(neg, d_mid + mu, d_lo), np.where(neg, dd_mid, dd_lo))
            hi = np.where(neg | done, hi, mid)
        return np.where(d_lo >= 0.0, f_lo + mu * lo, f_lo + mu * lo + np.minimum(d_lo, 0.0) * (hi - lo))


def _primal(decode: _Decode, member: np.ndarray, xmin: np.ndarray, fixed: float, floor: np.ndarray,
            g_min: np.ndarray, makespan: float, rel_gap: float = 1e-9) -> tuple[np.ndarray, list[np.ndarray]]:
    """Near-minimise ``sum_k W_k(X_k(g))`` over gaps ``g >= floor`` with ``sum g = makespan`` and
    ``X_k(g) = member[k] @ g - F >= xmin_k``: a log-barrier Newton method in the ``K`` gaps.

    Each execution's decode cell time is the epigraph variable ``v_i >= f_i(X) = tok_i*b +
    a*b*tok_i**2/u_i`` and ``v_i >= full_i = tok_i*(a/B + b)``, with barrier
    ``t*v - log(v - f) - log(v - full)``; ``v_i`` is minimised out in closed form (a smooth
    ``max(f, full)``), so the kink where the batch reaches ``B`` gets the right multiplier.
    Returns the gaps and, for the last few barrier parameters, the multipliers ``mu_k`` of
    ``X_k <= member[k] @ g - F`` (for the dual; a larger ``t`` is closer to optimal but its tiny
    slacks are less accurate in floating point, so the caller tries each).
    """
    K = len(g_min)
    step_of, full = decode.step, decode.full
    ab2 = decode.a * decode.b * decode.tok**2
    base = decode.o + decode.a * decode.tok
    tb = decode.tok * decode.b
    m = 2 * len(full) + 2 * K  # barrier terms: the duality gap of a centred point is m/t

    def pieces(g: np.ndarray, t: float, order: int):
        """Slacks, ``p = v - f`` per execution and the barrier's gradient (and Hessian) in ``g``."""
        x = member @ g - fixed
        sx, sg = x - xmin, g - floor
        if np.any(sx <= 0.0) or np.any(sg <= 0.0):
            return None
        u = x[step_of] - base
        f, f1 = tb + ab2 / u, -ab2 / u**2
        d = f - full
        r = np.sqrt(0.25 * d * d + 1.0 / t**2)
        small = 1.0 / t + (1.0 / t**2) / (r + 0.5 * np.abs(d))  # no cancellation
        p = np.where(d >= 0.0, small, 0.5 * np.abs(d) + 1.0 / t + r)
        grad = member.T @ (decode._sum(f1 / p) - 1.0 / sx) - 1.0 / sg
        if order < 2:
            return x, sx, sg, u, p, grad, None
        wide = 2.0 * r + np.abs(d)
        c = np.where(d >= 0.0, 1.0 / (t**2 * r * wide), wide / (4.0 * r))  # 1 - dv/df, no cancellation
        hx = decode._sum((2.0 * ab2 / u**3) / p + c * f1**2 / p**2) + 1.0 / sx**2
        hess = member.T @ (hx[:, None] * member) + np.diag(1.0 / sg**2)
        return x, sx, sg, u, p, grad, hess

    g = g_min + (makespan - g_min.sum()) / K  # strictly inside: every slack >= the added share
    phi0 = float(decode(member @ g - fixed)[0].sum())
    t = m / max(1e-2 * phi0, 1e-300)
    mus: list[np.ndarray] = []
    for _ in range(80):
        for _ in range(100):
            _, _, _, _, _, grad, hess = pieces(g, t, 2)
            scale = 1.0 / np.sqrt(np.diag(hess))  # equilibrate: the barrier terms span many decades
            kkt = np.zeros((K + 1, K + 1))
            kkt[:K, :K], kkt[:K, K], kkt[K, :K] = hess * np.outer(scale, scale), scale, scale
            rhs = np.concatenate([-grad * scale, [0.0]])
            try:
                step = np.linalg.solve(kkt, rhs)[:K] * scale
            except np.linalg.LinAlgError:
                step = np.linalg.lstsq(kkt, rhs, rcond=None)[0][:K] * scale
            step -= step.mean()  # keep sum g exact
            dec = -float(grad @ step)
            if not np.isfinite(dec) or dec <= 1e-14:
                break
            # Backtracking on the directional derivative (convex along the line) rather than on
            # values: no differences of large numbers, so it keeps working at any t.
            s, ok = 1.0, False
            while s > 1e-30:
                trial = pieces(g + s * step, t, 1)
                if trial is not None and float(trial[5] @ step) <= (0.5 * dec if dec < 1e-3 else 0.0):
                    ok = True
                    break
                s *= 0.5
            if not ok:
                break
            g = g + s * step
            if s * np.abs(step).max() <= 1e-16 * np.abs(g).max():
                break
        if m / t <= 1e-5 * phi0:
            _, sx, _, u, p, _, _ = pieces(g, t, 1)
            mus.append(decode._sum((ab2 / u**2) / (t * p)) + 1.0 / (t * sx))
        if m / t <= rel_gap * phi0:
            break
        t *= 20.0
    return g, mus


def batched_bound(workload: Workload, *, staleness: int | None = None, cells: int | None = None,
                  step_capacity: bool = True) -> dict:
    """A lower bound on the emulated wall time of any schedule of ``workload`` that charges batching.

    :func:`lower_bound` lets every execution run alone for the critical path while charging
    full-batch cell time for the work. Here a generation decoding at per-token time
    ``tau = a + b*k`` (batch ``k``, ``1 <= k <= B``) costs ``a/k + b`` cell-seconds per token, so
    fast executions are dear. The bound is that of a convex relaxation (fluid, clairvoyant, free
    migration, fractional batches), never above its optimum, and at least :func:`lower_bound`'s.

    Relaxation. ``C`` = cells (or the most the timeline ever has), ``F = step_fixed_s``, ``t_k`` step
    k's ``train_s_per_token``, ``E(k)`` the end of update k, ``S(k) = E(k-1-s)`` (0 when
    ``k-1-s < 0``). Step k's window ``X_k = E(k) - F - S(k)``. Its execution ``i`` (``tok_i`` tokens)
    has ``o_i = tool latency + c*new prompt tokens*calls + t_k*tok_i/C`` of the window for other
    things, so its per-token time is at most ``(X_k - o_i)/tok_i`` and (Jensen on ``a/k``) its
    decode costs at least ``tok_i*(a/k_i + b)`` with ``k_i = min(B, ((X_k - o_i)/tok_i - a)/b)``.
    ``W_k(X)`` = that, summed over the step, plus its prefill (convex, decreasing)::

        minimise M = E(K-1)  subject to
          E(k) >= E(k-1) + G_k,   X_k >= Xmin_k,
          sum_k W_k(X_k) + sum_k (t_k * tokens_k + F) <= C*M  (or cell_seconds(M))

    ``G_k = F + t_k*tokens_k/C``: step k's gradients are computed at the weights of update k-1, so
    all of its training (on at most ``C`` cells) and its optimizer step follow that update.
    ``Xmin_k`` is the longest execution alone (``k_i = 1``) and, with ``step_capacity``, also the
    root of ``C*X = W_k(X) + t_k*tokens_k`` (all of step k's rollout and training happen in its
    window, on at most ``C`` cells).

    Solution. In gaps ``g_j = E(j) - E(j-1)`` (``g_j >= G_j``, ``sum g = M``),
    ``X_k = sum_{j in J_k} g_j - F`` with ``J_k = {max(0, k-s), ..., k}``; ``Phi(M)`` = the least
    ``sum_k W_k(X_k)`` over such gaps. Dualising ``X_k <= sum_{J_k} g - F`` (``mu_k``) and
    ``sum g = M``, for any ``mu >= 0`` and ``M >= sum G`` weak duality gives::

        Phi(M) >= D_mu(M) = sum_k min_{X >= Xmin_k} [W_k(X) + mu_k X]
                            + F sum_k mu_k - sum_j nu_j G_j - (M - sum G) max_j nu_j,
        nu_j = sum_{k: j in J_k} mu_k                         (linear in M)

    so ``M`` is infeasible when ``D_mu(M) > capacity(M) - training`` (checked with a margin for
    rounding; the inner minimum is bounded from below, not approximated), and the bound is the
    largest such ``M``. This holds for any ``mu``, however found: ``mu`` comes from a log-barrier
    Newton solution of the primal at ``M`` (``mu_k = -W_k'(X_k)`` and the barrier's multipliers,
    which pick the right subgradient where an execution's batch reaches ``B``), and ``M`` follows
    Newton's method on the capacity equation (the next ``M`` is where the line ``D_mu`` meets it).

    Parameters
    ----------
    staleness, cells
        As for :func:`lower_bound`.
    step_capacity
        Also require each step's own work to fit its window (valid, tighter; ``False`` gives the
        relaxation without it).

    Returns
    -------
    dict
        ``batched_bound_s``; ``lower_bound_s`` (the loose one); ``relaxation_critical_path_s``
        (least ``M`` under the chain alone); ``upper_s`` (a makespan at which the relaxation was found
        feasible: its optimum lies in ``[batched_bound_s, upper_s]``; ``None`` if none);
        ``windows_s``, ``step_end_s``, ``mean_batch`` (per step) and ``rollout_work_s``
        (cell-seconds) of the primal at ``upper_s``; ``min_windows_s`` (``Xmin_k``);
        ``train_work_s``; ``iterations``; ``staleness``; ``cells``.
    """
    loose = lower_bound(workload, staleness=staleness, cells=cells)
    s, n_cells = loose["staleness"], loose["cells"]
    fixed = workload.cost.step_fixed_s
    a, b, batch, c = workload.a, workload.b, workload.cost.max_batch, workload.c
    K = workload.steps
    step_of, toks, over = [], [], []
    prefill, train = np.zeros(K), np.zeros(K)
    for k in range(K):
        t = workload.at(k).train_s_per_token
        specs = workload.executions(k)
        tok = np.array([e.tokens for e in specs], dtype=np.float64)
        pre = np.array([c * e.new_prompt_tokens * e.num_calls for e in specs], dtype=np.float64)
        lat = np.array([e.tool_latency_s for e in specs], dtype=np.float64)
        step_of.append(np.full(len(specs), k))
        toks.append(tok)
        over.append(lat + pre + t * tok / n_cells)
        prefill[k], train[k] = pre.sum(), t * tok.sum()
    decode = _Decode(np.concatenate(step_of), np.concatenate(toks), np.concatenate(over), prefill, a, b, batch)
    train_total = float(train.sum()) + K * fixed

    xmin = decode.x_exec.copy()
    if step_capacity:  # largest X (to rounding) with C*X < W_k(X) + t_k*tokens_k: below the root
        lo = xmin.copy()
        hi = np.maximum(lo, (decode(lo)[0] + train) / n_cells)
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            short = n_cells * mid < decode(mid)[0] + train
            lo, hi = np.where(short, mid, lo), np.where(short, hi, mid)
        xmin = np.maximum(xmin, lo)

    floor = fixed + train / n_cells  # G_k
    member = np.zeros((K, K))
    for k in range(K):
        member[k, max(0, k - s): k + 1] = 1.0
    ends: list[float] = []
    for k in range(K):
        start = ends[k - 1 - s] if k - 1 - s >= 0 else 0.0
        ends.append(max((ends[k - 1] if k else 0.0) + floor[k], start + fixed + float(xmin[k])))
    crit = ends[-1]
    g_min = np.diff(np.concatenate([[0.0], ends]))

    if cells is None:
        capacity = workload.cell_seconds
    else:
        def capacity(m: float) -> float:
            return n_cells * m

    def certify(mu: np.ndarray) -> float:
        """Largest M with D_mu(M) > capacity(M) - training (every smaller M is then infeasible)."""
        nu = member.T @ mu
        top = float(nu.max())
        const = (float(decode.min_plus_linear(mu, xmin).sum()) + fixed * float(mu.sum()) - float(nu @ floor)
                 + float(floor.sum()) * top)

        def infeasible(m: float) -> bool:
            cap = capacity(m) - train_total
            return const - top * m > cap + 1e-9 * (abs(cap) + abs(const) + 1.0)

        lo = float(floor.sum())
        if not infeasible(lo):
            return -np.inf
        hi = max(2.0 * lo, 1.0)
        while infeasible(hi):
            lo, hi = hi, 2.0 * hi
            if hi > 1e300:
                raise ValueError("that much work never fits the cells")
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if mid <= lo or mid >= hi:
                break
            lo, hi = (mid, hi) if infeasible(mid) else (lo, mid)
        return lo

    def solve(m: float) -> float:
        g, mus = _primal(decode, member, xmin, fixed, floor, g_min, m)
        plain = np.maximum(-decode(member @ g - fixed, 1)[1], 0.0)  # -W_k'(X_k), no barrier terms
        return max(certify(mu) for mu in [*mus, plain])

    best = max(loose["lower_bound_s"], crit)
    m = max(best, crit * (1 + 1e-6))
    iterations = 0
    for _ in range(40):
        iterations += 1
        cert = solve(m)
        prev, best = best, max(best, cert)
        if cert <= crit * (1 + 1e-9) or abs(cert - m) <= 1e-9 * m or (iterations > 1 and best <= prev * (1 + 1e-12)):
            break
        m = cert

    for margin in (1e-7, 1e-5, 1e-3):  # a makespan just above at which the relaxation is feasible
        m_up = max(best, crit * (1 + 1e-9)) * (1 + margin)
        g, _ = _primal(decode, member, xmin, fixed, floor, g_min, m_up)
        x = member @ g - fixed
        work = float(decode(x)[0].sum())
        fits = work + train_total <= capacity(m_up)
        if fits:
            break
    return {
        "batched_bound_s": best,
        "lower_bound_s": loose["lower_bound_s"],
        "relaxation_critical_path_s": crit,
        "upper_s": m_up if fits else None,
        "windows_s": x.tolist(),
        "step_end_s": np.cumsum(g).tolist(),
        "mean_batch": decode.mean_batch(x).tolist(),
        "rollout_work_s": work,
        "train_work_s": train_total,
        "min_windows_s": xmin.tolist(),
        "iterations": iterations,
        "staleness": s,
        "cells": n_cells,
    }
