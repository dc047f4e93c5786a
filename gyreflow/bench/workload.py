"""Benchmark workloads: what the emulated placement benchmark runs, and its cost model.

A :class:`Workload` is loaded from a JSON file (:func:`load_workload`; the shipped ones are
``xlong-tail`` and ``flat``, see ``workloads.md``). All times are *emulated seconds*; a workload's
``time_scale`` says how many of them pass per wall-clock second.

Cost model (one cell = one engine replica or one trainer shard)

- decode with ``k`` live generations (``k <= max_batch``): one iteration makes one token for each of
  them and takes ``iteration_s(k) = a + b*k`` with ``a = a_over_b * b``;
- prefill of a call's new prompt tokens: ``c = prefill_s_per_token`` per token, batched with decode
  (the whole cell spends that time);
- migration of a live generation with context ``n``: ``n * kv_bytes_per_token`` real bytes sent
  between workers plus ``handoff_s`` for the moved request;
- training: ``t = train_s_per_token`` per trained (generated) token, divided across trainer cells,
  plus ``step_fixed_s`` per step (optimizer and weight publication).

Executions are drawn deterministically from ``(seed, step, task, sample)``
(:meth:`Workload.executions`), so every placement mode runs the very same executions.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the file and the field."""


# ---------------------------------------------------------------------------------------- pieces


_DISTS = {
    "lognormal": ({"median", "sigma"}, {"cap"}),
    "uniform": ({"low", "high"}, set()),
    "constant": ({"value"}, set()),
}
"""Distribution kind -> (required parameters, optional parameters)."""


@dataclass(frozen=True)
class Distribution:
    """A positive scalar distribution.

    JSON: ``{"dist": "lognormal", "median": m, "sigma": s, "cap": c}`` (``cap`` optional),
    ``{"dist": "uniform", "low": l, "high": h}`` or ``{"dist": "constant", "value": v}``. A field
    may name a unit suffix for its parameters (``sigma`` never has one): the tool latency is given
    in full-batch decode iterations, e.g. ``"median_full_batch_iterations": 200``.
    """

    dist: str
    """``"lognormal"``, ``"uniform"`` or ``"constant"``."""
    median: float = 0.0
    """Lognormal: the median (``exp(mu)``)."""
    sigma: float = 0.0
    """Lognormal: standard deviation of the log."""
    cap: float | None = None
    """Lognormal: largest value (draws above it are set to it); ``None`` for none."""
    low: float = 0.0
    """Uniform: smallest value."""
    high: float = 0.0
    """Uniform: largest value."""
    value: float = 0.0
    """Constant: the value."""

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """``size`` draws (float64) from ``rng``."""
        if self.dist == "lognormal":
            x = self.median * np.exp(self.sigma * rng.standard_normal(size))
            return np.minimum(x, self.cap) if self.cap is not None else x
        if self.dist == "uniform":
            return rng.uniform(self.low, self.high, size)
        return np.full(size, float(self.value))

    def median_value(self) -> float:
        """The distribution's median (of the capped law for a lognormal)."""
        if self.dist == "lognormal":
            return min(self.median, self.cap) if self.cap is not None else self.median
        if self.dist == "uniform":
            return (self.low + self.high) / 2
        return self.value

    def to_dict(self, suffix: str = "") -> dict:
        keys = sorted(set().union(*_DISTS[self.dist]))
        out: dict[str, Any] = {"dist": self.dist}
        for k in keys:
            v = getattr(self, k)
            if v is not None:
                out[k if k == "sigma" else k + suffix] = v
        return out


@dataclass(frozen=True)
class Cost:
    """The cost model's constants (JSON section ``cost``); emulated seconds."""

    decode_b_s: float = 0.0005
    """``b``: decode seconds per live generation per iteration."""
    a_over_b: float = 16.0
    """``a / b``: the fixed part of an iteration (memory-bound decode), in units of ``b``."""
    max_batch: int = 32
    """Most live generations on one rollout cell; more wait in FIFO order."""
    prefill_s_per_token: float = 0.0001
    """``c``: seconds per prefilled (uncached) prompt token, spent by the whole cell."""
    train_share: float = 0.3
    """Share of a step's cell-time that training takes at ideal packing; calibrates ``t``."""
    step_fixed_s: float = 30.0
    """Fixed optimizer and weight-publication seconds per step (on one cell)."""
    kv_bytes_per_token: int = 16
    """Real bytes of KV cache per context token that a migration sends."""
    handoff_s: float = 0.5
    """Fixed delay a migrated generation pays once in its new engine (that request only)."""

    @property
    def b(self) -> float:
        """Decode seconds per live generation per iteration."""
        return self.decode_b_s

    @property
    def a(self) -> float:
        """Fixed decode seconds per iteration: ``a_over_b * b``."""
        return self.a_over_b * self.decode_b_s

    @property
    def c(self) -> float:
        """Prefill seconds per token."""
        return self.prefill_s_per_token

    def iteration_s(self, k: int) -> float:
        """Seconds of one decode iteration with ``k`` live generations: ``a + b*k``."""
        return self.a + self.b * k

    @property
    def full_batch_s_per_token(self) -> float:
        """Cell seconds per generated token at a full batch: ``iteration_s(max_batch)/max_batch``."""
        return self.iteration_s(self.max_batch) / self.max_batch


@dataclass(frozen=True)
class ExecutionSpec:
    """One execution of the workload: its generated tokens, cut into model calls."""

    execution_id: str
    """Unique in the run: ``s{step}-t{task}-x{sample}``."""
    step: int
    """RL step it belongs to."""
    task: int
    """Task index in the step (the group)."""
    sample: int
    """Sample index within the group."""
    tokens: int
    """Tokens generated over all its calls."""
    calls: tuple[tuple[int, float], ...]
    """Per model call: (tokens it generates, tool latency in seconds after it; 0.0 after the last)."""
    new_prompt_tokens: int = 0
    """New prompt tokens each call brings (the task prompt for the first, a tool result after)."""

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    @property
    def tool_latency_s(self) -> float:
        """Sum of its tool latencies."""
        return float(sum(lat for _, lat in self.calls))

    def context_tokens(self, i: int) -> int:
        """Prompt length of call ``i``: every earlier call's prompt and completion plus its new tokens."""
        return (i + 1) * self.new_prompt_tokens + sum(n for n, _ in self.calls[:i])


def emulated_tokens_bytes(n: int, bytes_per_token: int) -> np.ndarray:
    """Real bytes standing for the KV cache of ``n`` tokens: ``n * bytes_per_token`` zero bytes.

    Moving the array between Dask workers costs what moving that much KV would.
    """
    return np.zeros(max(0, int(n)) * int(bytes_per_token), dtype=np.uint8)


# ---------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class Workload:
    """A benchmark workload: the run's shape, its executions' distributions and the cost model."""

    name: str
    """Short name (the shipped files are named after it)."""
    description: str
    """What it models, one or two sentences."""
    cells: int
    """Cells (Dask workers that serve as rollout or trainer)."""
    steps: int
    """RL steps (policy updates)."""
    staleness: int
    """Staleness bound of ``async`` and ``elastic``: step k's executions may start once update
    ``k - 1 - staleness`` is done (``colocated`` uses 0)."""
    tasks_per_step: int
    """Tasks (groups) per step."""
    samples_per_task: int
    """Executions per task."""
    tokens_per_execution: Distribution
    """Tokens one execution generates in all (rounded, at least 1)."""
    tokens_per_call: int
    """Tokens one model call generates (the last call of an execution generates the rest)."""
    tool_output_tokens: int
    """New prompt tokens each call brings (tool result; the task prompt for the first call)."""
    tool_latency: Distribution
    """Tool latency between calls, in full-batch decode iterations (``*_full_batch_iterations``)."""
    cost: Cost
    """The cost model's constants."""
    time_scale: float
    """Emulated seconds per wall-clock second."""
    seed: int
    """Seed of every execution's draws (with step, task and sample)."""

    # -------------------------------------------------------------- derived

    @property
    def a(self) -> float:
        """Fixed decode seconds per iteration."""
        return self.cost.a

    @property
    def b(self) -> float:
        """Decode seconds per live generation per iteration."""
        return self.cost.b

    @property
    def c(self) -> float:
        """Prefill seconds per token."""
        return self.cost.c

    def iteration_s(self, k: int) -> float:
        """Seconds of one decode iteration with ``k`` live generations: ``a + b*k``."""
        return self.cost.iteration_s(k)

    @property
    def executions_per_step(self) -> int:
        return self.tasks_per_step * self.samples_per_task

    @property
    def rollout_s_per_token(self) -> float:
        """Rollout cell-seconds per generated token at ideal packing.

        ``iteration_s(max_batch)/max_batch + c * tool_output_tokens / tokens_per_call``: decode at a
        full batch plus the prefill of the new prompt tokens each call brings, per generated token.
        """
        return self.cost.full_batch_s_per_token + self.c * self.tool_output_tokens / self.tokens_per_call

    @property
    def train_s_per_token(self) -> float:
        """``t``: trainer cell-seconds per trained token.

        Calibrated so that at ideal packing training is ``train_share`` of a step's cell-time
        (the fixed per-step cost left aside): with ``r`` = :attr:`rollout_s_per_token`,
        ``t / (t + r) = train_share``, i.e. ``t = train_share / (1 - train_share) * r``.
        """
        share = self.cost.train_share
        return share / (1.0 - share) * self.rollout_s_per_token

    @property
    def tool_latency_median_s(self) -> float:
        """Median tool latency in seconds: median iterations times ``iteration_s(max_batch)``."""
        return self.tool_latency.median_value() * self.iteration_s(self.cost.max_batch)

    def train_s(self, tokens: int, trainer_cells: int = 1) -> float:
        """Seconds to train ``tokens`` tokens on ``trainer_cells`` cells (without the fixed cost)."""
        return self.train_s_per_token * tokens / max(1, trainer_cells)

    # -------------------------------------------------------------- executions

    def execution(self, step: int, task: int, sample: int) -> ExecutionSpec:
        """The execution ``(step, task, sample)``: a pure function of it and ``seed``."""
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, step, task, sample]))
        tokens = max(1, int(round(float(self.tokens_per_execution.sample(rng, 1)[0]))))
        n = math.ceil(tokens / self.tokens_per_call)
        sizes = [self.tokens_per_call] * (n - 1) + [tokens - self.tokens_per_call * (n - 1)]
        it_s = self.iteration_s(self.cost.max_batch)
        lat = self.tool_latency.sample(rng, n - 1) * it_s
        calls = tuple((int(s), float(x)) for s, x in zip(sizes, [*lat.tolist(), 0.0]))
        return ExecutionSpec(
            execution_id=f"s{step}-t{task}-x{sample}",
            step=step,
            task=task,
            sample=sample,
            tokens=tokens,
            calls=calls,
            new_prompt_tokens=self.tool_output_tokens,
        )

    def executions(self, step: int) -> list[ExecutionSpec]:
        """Step ``step``'s executions, task-major (``tasks_per_step * samples_per_task`` of them)."""
        return [
            self.execution(step, task, sample)
            for task in range(self.tasks_per_step)
            for sample in range(self.samples_per_task)
        ]

    def min_execution_s(self, spec: ExecutionSpec) -> float:
        """Shortest possible duration of an execution: alone on a cell, every prefix cached.

        Each call prefills its new prompt tokens (``c`` each) and decodes at ``iteration_s(1)`` per
        token; the tool latencies come on top.
        """
        decode = spec.tokens * self.iteration_s(1)
        prefill = self.c * spec.new_prompt_tokens * spec.num_calls
        return decode + prefill + spec.tool_latency_s

    def rollout_work_s(self, spec: ExecutionSpec) -> float:
        """Least rollout cell-seconds of an execution: full-batch decode plus its calls' prefill."""
        return spec.tokens * self.cost.full_batch_s_per_token + self.c * spec.new_prompt_tokens * spec.num_calls

    # -------------------------------------------------------------- JSON

    def to_dict(self) -> dict:
        """The JSON form (:func:`load_workload` reads it back)."""
        return {
            "name": self.name,
            "description": self.description,
            "cells": self.cells,
            "steps": self.steps,
            "staleness": self.staleness,
            "tasks_per_step": self.tasks_per_step,
            "samples_per_task": self.samples_per_task,
            "tokens_per_execution": self.tokens_per_execution.to_dict(),
            "tokens_per_call": self.tokens_per_call,
            "tool_output_tokens": self.tool_output_tokens,
            "tool_latency": self.tool_latency.to_dict(_LATENCY_SUFFIX),
            "cost": dataclasses.asdict(self.cost),
            "time_scale": self.time_scale,
            "seed": self.seed,
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "Workload":
        """Validate and build; every problem raises :class:`WorkloadError` naming ``source`` and the field."""
        p = _Parser(source)
        d = p.obj(data, "")
        top = {
            "name", "description", "cells", "steps", "staleness", "tasks_per_step", "samples_per_task",
            "tokens_per_execution", "tokens_per_call", "tool_output_tokens", "tool_latency", "cost",
            "time_scale", "seed",
        }  # fmt: skip
        p.no_unknown(d, top, "")
        cost_d = p.obj(p.required(d, "cost", ""), "cost")
        p.no_unknown(cost_d, {f.name for f in dataclasses.fields(Cost)}, "cost")
        cost = Cost(
            decode_b_s=p.num(cost_d, "decode_b_s", "cost", positive=True),
            a_over_b=p.num(cost_d, "a_over_b", "cost", positive=False),
            max_batch=p.integer(cost_d, "max_batch", "cost", positive=True),
            prefill_s_per_token=p.num(cost_d, "prefill_s_per_token", "cost", positive=False),
            train_share=p.num(cost_d, "train_share", "cost", positive=False),
            step_fixed_s=p.num(cost_d, "step_fixed_s", "cost", positive=False),
            kv_bytes_per_token=p.integer(cost_d, "kv_bytes_per_token", "cost", positive=True),
            handoff_s=p.num(cost_d, "handoff_s", "cost", positive=False),
        )
        if not cost.train_share < 1.0:
            p.fail("cost.train_share", f"must be below 1, got {cost.train_share}")
        name = d.get("name", Path(source).stem if source.endswith(".json") else None)
        if not isinstance(name, str) or not name:
            p.fail("name", "must be a non-empty string")
        description = d.get("description", "")
        if not isinstance(description, str):
            p.fail("description", "must be a string")
        return cls(
            name=name,
            description=description,
            cells=p.integer(d, "cells", "", positive=True),
            steps=p.integer(d, "steps", "", positive=True),
            staleness=p.integer(d, "staleness", "", positive=False),
            tasks_per_step=p.integer(d, "tasks_per_step", "", positive=True),
            samples_per_task=p.integer(d, "samples_per_task", "", positive=True),
            tokens_per_execution=p.dist(p.required(d, "tokens_per_execution", ""), "tokens_per_execution", ""),
            tokens_per_call=p.integer(d, "tokens_per_call", "", positive=True),
            tool_output_tokens=p.integer(d, "tool_output_tokens", "", positive=False),
            tool_latency=p.dist(p.required(d, "tool_latency", ""), "tool_latency", _LATENCY_SUFFIX),
            cost=cost,
            time_scale=p.num(d, "time_scale", "", positive=True),
            seed=p.integer(d, "seed", "", positive=False),
        )


_LATENCY_SUFFIX = "_full_batch_iterations"


class _Parser:
    """Typed field access that raises :class:`WorkloadError` naming the file and the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, why: str):
        raise WorkloadError(f"{self.source}: field {field!r} {why}")

    @staticmethod
    def _path(prefix: str, key: str) -> str:
        return f"{prefix}.{key}" if prefix else key

    def obj(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            if not where:
                raise WorkloadError(f"{self.source}: must hold a JSON object, got {type(value).__name__}")
            self.fail(where, f"must be an object, got {type(value).__name__}")
        return value

    def required(self, d: dict, key: str, prefix: str) -> Any:
        if key not in d:
            self.fail(self._path(prefix, key), "is missing")
        return d[key]

    def no_unknown(self, d: dict, known: set[str], prefix: str) -> None:
        unknown = sorted(set(d) - known)
        if unknown:
            self.fail(self._path(prefix, unknown[0]), f"is unknown (known: {', '.join(sorted(known))})")

    def num(self, d: dict, key: str, prefix: str, *, positive: bool) -> float:
        field = self._path(prefix, key)
        v = self.required(d, key, prefix)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(field, f"must be a number, got {type(v).__name__}")
        v = float(v)
        if not math.isfinite(v):
            self.fail(field, f"must be finite, got {v}")
        if positive and v <= 0:
            self.fail(field, f"must be positive, got {v}")
        if not positive and v < 0:
            self.fail(field, f"must not be negative, got {v}")
        return v

    def integer(self, d: dict, key: str, prefix: str, *, positive: bool) -> int:
        field = self._path(prefix, key)
        v = self.required(d, key, prefix)
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(field, f"must be an integer, got {type(v).__name__}")
        if positive and v <= 0:
            self.fail(field, f"must be positive, got {v}")
        if not positive and v < 0:
            self.fail(field, f"must not be negative, got {v}")
        return int(v)

    def dist(self, value: Any, where: str, suffix: str) -> Distribution:
        d = self.obj(value, where)
        kind = self.required(d, "dist", where)
        if kind not in _DISTS:
            self.fail(f"{where}.dist", f"is an unknown distribution {kind!r} (known: {', '.join(_DISTS)})")
        req, opt = _DISTS[kind]

        def key(k: str) -> str:
            return k if k == "sigma" else k + suffix

        self.no_unknown(d, {"dist"} | {key(k) for k in req | opt}, where)
        kw: dict[str, Any] = {"dist": kind}
        for k in sorted(req):
            kw[k] = self.num(d, key(k), where, positive=(k != "sigma"))
        for k in sorted(opt):
            if key(k) in d:
                kw[k] = self.num(d, key(k), where, positive=True)
        if kind == "uniform" and kw["high"] < kw["low"]:
            self.fail(f"{where}.{key('high')}", f"must be at least {key('low')} ({kw['low']}), got {kw['high']}")
        return Distribution(**kw)


# ---------------------------------------------------------------------------------------- loading


def _shipped_dir():
    return resources.files("gyreflow.bench") / "workloads"


def available_workloads() -> list[str]:
    """Names of the workloads shipped with gyreflow."""
    return sorted(p.name[: -len(".json")] for p in _shipped_dir().iterdir() if p.name.endswith(".json"))


def load_workload(path_or_name: str | Path) -> Workload:
    """Load a workload from a JSON file, or a shipped one by name (``"xlong-tail"``, ``"flat"``).

    Raises
    ------
    WorkloadError
        No such file or shipped name, not JSON, or a field that is missing, of the wrong type,
        out of range, an unknown distribution or an unknown key; the message names the file and
        the field.
    """
    text_source = str(path_or_name)
    path = Path(path_or_name)
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    else:
        looks_like_path = isinstance(path_or_name, Path) or text_source.endswith(".json") or "/" in text_source
        shipped = _shipped_dir() / f"{text_source}.json"
        if looks_like_path or not shipped.is_file():
            raise WorkloadError(
                f"{text_source}: no such workload file or shipped workload (shipped: {', '.join(available_workloads())})"
            )
        text = shipped.read_text(encoding="utf-8")
        text_source = f"{text_source}.json"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise WorkloadError(f"{text_source}: not valid JSON: {err}") from None
    return Workload.from_dict(data, source=text_source)


# ---------------------------------------------------------------------------------------- lower bound


def lower_bound(workload: Workload, *, staleness: int | None = None, cells: int | None = None) -> dict:
    """A lower bound on the emulated wall time of any schedule of ``workload``.

    ``lower_bound_s = max(total_work_s, critical_path_s)``; neither term can be beaten by a perfect
    scheduler with free, instant migration.

    total_work_s
        All cell work divided by the cells. Rollout work of an execution at its cheapest (full
        batches, every prefix cached): ``tokens * iteration_s(max_batch)/max_batch`` plus
        ``c * new_prompt_tokens`` per call. Training per step: ``t * tokens_of_step`` plus
        ``step_fixed_s`` (the fixed cost counted once per step, on one cell).
    critical_path_s
        The end ``E(steps-1)`` of the last update under the dependencies. With staleness ``s``,
        ``F = step_fixed_s``, ``C = cells``, ``D_i`` the shortest duration of execution ``i`` (alone on
        a cell: per call ``c * new tokens + tokens * iteration_s(1)``, plus its tool latencies,
        :meth:`Workload.min_execution_s`), ``tok_i`` its tokens, ``W_k`` step k's rollout work and
        ``T_k`` its tokens::

            S(k) = E(k-1-s) if k-1-s >= 0 else 0      # step k's executions start no earlier
            E(k) = F + max( E(k-1)                      # updates are sequential (E(-1) = 0)
                          , S(k) + max_i (D_i + t*tok_i/C)   # an execution, then its gradients on
                                                              # every cell at once
                          , S(k) + (W_k + t*T_k)/C )     # all of step k's work, on every cell

        Each term is a necessary condition: the optimizer's ``F`` follows every gradient of its step
        and the previous update, gradients of an execution follow its end, and nothing of step k
        starts before ``S(k)``. Work of other steps running meanwhile is ignored (which only
        loosens the bound).

    Parameters
    ----------
    staleness
        Defaults to the workload's; ``colocated`` runs on-policy (0).
    cells
        Defaults to the workload's.

    Returns
    -------
    dict
        ``lower_bound_s``, ``critical_path_s``, ``total_work_s``, ``rollout_work_s`` and
        ``train_work_s`` (cell-seconds, all steps), ``longest_execution_s`` (shortest possible
        duration of the longest execution), ``step_end_s`` (``E(k)`` per step), ``staleness``,
        ``cells``.
    """
    s = workload.staleness if staleness is None else int(staleness)
    n_cells = workload.cells if cells is None else int(cells)
    if s < 0 or n_cells < 1:
        raise ValueError("staleness must be >= 0 and cells >= 1")
    t = workload.train_s_per_token
    fixed = workload.cost.step_fixed_s
    ends: list[float] = []
    rollout_total = train_total = 0.0
    longest = 0.0
    for k in range(workload.steps):
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
                prev,
                start + float(np.max(dur + t * tok / n_cells)),
                start + (work + t * tokens_k) / n_cells,
            )
        )
    total_work = (rollout_total + train_total) / n_cells
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
