"""Benchmark workloads: what the emulated placement benchmark runs, and its cost model.

A :class:`Workload` is loaded from a JSON file (:mod:`gyreflow.bench.workload_file`; the shipped
ones and the format are documented in ``gyreflow/bench/workloads/README.md``). All times are
*emulated seconds*; a workload's ``time_scale`` says how many of them pass per wall-clock second.

A workload may shift: its ``schedule`` changes the execution distribution or the training share
from a given step on (:meth:`Workload.at`), and its ``timeline`` has cells join and leave at given
emulated times.

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
import math
from dataclasses import dataclass
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


# ---------------------------------------------------------------------------------------- shifts


@dataclass(frozen=True)
class StepChange:
    """From step ``from_step`` on, these fields of the workload take new values (``None``: kept)."""

    from_step: int
    tokens_per_execution: Distribution | None = None
    tokens_per_call: int | None = None
    tool_output_tokens: int | None = None
    tool_latency: Distribution | None = None
    tasks_per_step: int | None = None
    samples_per_task: int | None = None
    train_share: float | None = None
    """The cost model's ``train_share`` (longer contexts cost more per trained token)."""

    def changed(self) -> dict[str, Any]:
        """The fields it sets."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "from_step" and getattr(self, f.name) is not None}


@dataclass(frozen=True)
class CellEvent:
    """At emulated time ``at``, ``join`` new cells join the cluster and the cells named in
    ``leave`` leave it (their live generations migrate first)."""

    at: float
    join: int = 0
    leave: tuple[str, ...] = ()


def cell_name(i: int) -> str:
    """Name of the ``i``-th cell of a workload (``cell-0`` ...; joiners continue the count)."""
    return f"cell-{i}"


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
    schedule: tuple[StepChange, ...] = ()
    """Changes from given steps on, in step order."""
    timeline: tuple[CellEvent, ...] = ()
    """Cells joining and leaving, in time order."""

    # -------------------------------------------------------------- shifts

    def at(self, step: int) -> "Workload":
        """The workload as it stands at ``step``: every change of the schedule up to it applied."""
        fields: dict[str, Any] = {}
        for change in self.schedule:
            if change.from_step <= step:
                fields.update(change.changed())
        if not fields:
            return self
        share = fields.pop("train_share", None)
        if share is not None:
            fields["cost"] = dataclasses.replace(self.cost, train_share=share)
        return dataclasses.replace(self, **fields)

    @property
    def max_cells(self) -> int:
        """Cells that ever exist in the run (the initial ones and every joiner)."""
        return self.cells + sum(e.join for e in self.timeline)

    def cells_over_time(self) -> list[tuple[float, int]]:
        """``(time, cells from then on)``, starting at 0."""
        out, n = [(0.0, self.cells)], self.cells
        for e in self.timeline:
            n += e.join - len(e.leave)
            out.append((e.at, n))
        return out

    def cell_seconds(self, until: float) -> float:
        """Cell-seconds that exist from 0 to ``until``."""
        points = self.cells_over_time() + [(math.inf, 0)]
        total = 0.0
        for (t0, n), (t1, _) in zip(points, points[1:]):
            if t0 >= until:
                break
            total += n * (min(t1, until) - t0)
        return total

    def time_for(self, cell_seconds: float) -> float:
        """The earliest time by which ``cell_seconds`` of cell time exist."""
        points = self.cells_over_time() + [(math.inf, 0)]
        done = 0.0
        for (t0, n), (t1, _) in zip(points, points[1:]):
            if n > 0 and done + n * (t1 - t0) >= cell_seconds:
                return t0 + (cell_seconds - done) / n
            done += n * (t1 - t0)
        raise ValueError("the cluster ends with no cell: that much work never fits")

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
        """The execution ``(step, task, sample)``: a pure function of it, the step's distribution
        and ``seed``."""
        if self.schedule:
            return self.at(step)._draw(step, task, sample)
        return self._draw(step, task, sample)

    def _draw(self, step: int, task: int, sample: int) -> ExecutionSpec:
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
        """Step ``step``'s executions, task-major (``tasks_per_step * samples_per_task`` of them, as
        the schedule has them at that step)."""
        w = self.at(step)
        return [w._draw(step, task, sample) for task in range(w.tasks_per_step) for sample in range(w.samples_per_task)]

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
        """The JSON form (:func:`~gyreflow.bench.workload_file.load_workload` reads it back)."""
        from gyreflow.bench.workload_file import workload_to_dict

        return workload_to_dict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "Workload":
        """Validate and build; every problem raises :class:`WorkloadError` naming ``source`` and the field."""
        from gyreflow.bench.workload_file import workload_from_dict

        return workload_from_dict(data, source)
