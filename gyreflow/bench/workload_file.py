"""Workload files: JSON in, :class:`~gyreflow.bench.workload.Workload` out, every error naming the
file and the field. The format is documented in ``gyreflow/bench/workloads/README.md``."""

from __future__ import annotations

import dataclasses
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

from gyreflow.bench.workload import CellEvent, Cost, Distribution, StepChange, Workload, WorkloadError, _DISTS, cell_name

_TOP = {
    "name", "description", "cells", "steps", "staleness", "tasks_per_step", "samples_per_task",
    "tokens_per_execution", "tokens_per_call", "tool_output_tokens", "tool_latency", "cost",
    "time_scale", "seed", "schedule", "timeline",
}  # fmt: skip
_CHANGES = {"from_step", "tokens_per_execution", "tokens_per_call", "tool_output_tokens", "tool_latency",
            "tasks_per_step", "samples_per_task", "train_share"}

MAX_EXECUTION_TOKENS = 100_000_000
"""Most tokens one execution may generate (100x the longest horizon gyreflow targets)."""
MAX_CALLS = 100_000
"""Most model calls one execution may make (each is an object in the run's memory)."""
MAX_MIGRATION_BYTES = 1 << 30
"""Most KV bytes one migration may send (the benchmark sends them between workers for real)."""
TIME_SCALES = (1e-3, 1e4)
"""Smallest and largest ``time_scale``."""
LOGNORMAL_REACH = 6.0
"""An uncapped lognormal's largest draw is taken as ``median * exp(6 * sigma)`` (about 1 in 10^9)."""


def workload_to_dict(w: Workload) -> dict:
    """The JSON form of ``w``."""
    out = {
        "name": w.name,
        "description": w.description,
        "cells": w.cells,
        "steps": w.steps,
        "staleness": w.staleness,
        "tasks_per_step": w.tasks_per_step,
        "samples_per_task": w.samples_per_task,
        "tokens_per_execution": w.tokens_per_execution.to_dict(),
        "tokens_per_call": w.tokens_per_call,
        "tool_output_tokens": w.tool_output_tokens,
        "tool_latency": w.tool_latency.to_dict(_LATENCY_SUFFIX),
        "cost": dataclasses.asdict(w.cost),
        "time_scale": w.time_scale,
        "seed": w.seed,
    }
    if w.schedule:
        out["schedule"] = [_change_to_dict(c) for c in w.schedule]
    if w.timeline:
        out["timeline"] = [{"at": e.at, **({"join": e.join} if e.join else {}), **({"leave": list(e.leave)} if e.leave else {})}
                           for e in w.timeline]
    return out


def _change_to_dict(c: StepChange) -> dict:
    out: dict[str, Any] = {"from_step": c.from_step}
    for k, v in c.changed().items():
        out[k] = v.to_dict(_LATENCY_SUFFIX if k == "tool_latency" else "") if isinstance(v, Distribution) else v
    return out


def workload_from_dict(data: Any, source: str = "<dict>") -> Workload:
    """Validate and build; every problem raises :class:`WorkloadError` naming ``source`` and the field."""
    p = _Parser(source)
    d = p.obj(data, "")
    p.no_unknown(d, _TOP, "")
    cost_d = p.obj(p.required(d, "cost", ""), "cost")
    p.no_unknown(cost_d, {f.name for f in dataclasses.fields(Cost)}, "cost")
    cost = Cost(
        decode_b_s=p.num(cost_d, "decode_b_s", "cost", positive=True),
        a_over_b=p.num(cost_d, "a_over_b", "cost", positive=False),
        max_batch=p.integer(cost_d, "max_batch", "cost", positive=True),
        prefill_s_per_token=p.num(cost_d, "prefill_s_per_token", "cost", positive=False),
        train_share=p.share(cost_d, "train_share", "cost"),
        step_fixed_s=p.num(cost_d, "step_fixed_s", "cost", positive=False),
        kv_bytes_per_token=p.integer(cost_d, "kv_bytes_per_token", "cost", positive=True),
        handoff_s=p.num(cost_d, "handoff_s", "cost", positive=False),
    )
    name = d.get("name", Path(source).stem if source.endswith(".json") else None)
    if not isinstance(name, str) or not name:
        p.fail("name", "must be a non-empty string")
    description = d.get("description", "")
    if not isinstance(description, str):
        p.fail("description", "must be a string")
    cells = p.integer(d, "cells", "", positive=True)
    steps = p.integer(d, "steps", "", positive=True)
    w = Workload(
        name=name,
        description=description,
        cells=cells,
        steps=steps,
        staleness=p.integer(d, "staleness", "", positive=False),
        tasks_per_step=p.integer(d, "tasks_per_step", "", positive=True),
        samples_per_task=p.integer(d, "samples_per_task", "", positive=True),
        tokens_per_execution=p.dist(p.required(d, "tokens_per_execution", ""), "tokens_per_execution", ""),
        tokens_per_call=p.integer(d, "tokens_per_call", "", positive=True),
        tool_output_tokens=p.integer(d, "tool_output_tokens", "", positive=False),
        tool_latency=p.dist(p.required(d, "tool_latency", ""), "tool_latency", _LATENCY_SUFFIX),
        cost=cost,
        time_scale=p.num(d, "time_scale", "", positive=True, within=TIME_SCALES),
        seed=p.integer(d, "seed", "", positive=False),
        schedule=_schedule(p, d.get("schedule", []), steps),
        timeline=_timeline(p, d.get("timeline", []), cells),
    )
    _check_sizes(p, w)
    return w


def _check_sizes(p: "_Parser", w: Workload) -> None:
    """Refuse executions the benchmark could not emulate: too many tokens, calls or KV bytes."""
    for k in range(w.steps):
        at = w.at(k)
        where = next((f"schedule[{i}]" for i, c in reversed(list(enumerate(w.schedule)))
                      if c.from_step <= k and c.tokens_per_execution is not None), None)
        field = f"{where}.tokens_per_execution" if where else "tokens_per_execution"
        dist = at.tokens_per_execution
        hi = dist.high if dist.dist == "uniform" else dist.value if dist.dist == "constant" else (
            dist.cap if dist.cap is not None else dist.median * math.exp(min(600.0, LOGNORMAL_REACH * dist.sigma)))
        if hi > MAX_EXECUTION_TOKENS:
            hint = "; give it a cap" if dist.dist == "lognormal" and dist.cap is None else ""
            p.fail(field, f"reaches {hi:,.0f} tokens at step {k}; at most {MAX_EXECUTION_TOKENS:,}{hint}")
        calls = math.ceil(hi / at.tokens_per_call)
        if calls > MAX_CALLS:
            p.fail(field, f"at {at.tokens_per_call:,} tokens per call makes up to {calls:,} calls an execution at "
                          f"step {k}; at most {MAX_CALLS:,} (raise tokens_per_call)")
        context = hi + calls * at.tool_output_tokens
        if context * w.cost.kv_bytes_per_token > MAX_MIGRATION_BYTES:
            p.fail("cost.kv_bytes_per_token", f"makes a migration of a {context:,.0f}-token context send "
                                              f"{context * w.cost.kv_bytes_per_token:,.0f} bytes; at most "
                                              f"{MAX_MIGRATION_BYTES:,}")


def _schedule(p: "_Parser", value: Any, steps: int) -> tuple[StepChange, ...]:
    out, last = [], -1
    for i, raw in enumerate(p.items(value, "schedule")):
        where = f"schedule[{i}]"
        c = p.obj(raw, where)
        p.no_unknown(c, _CHANGES, where)
        step = p.integer(c, "from_step", where, positive=False)
        if step >= steps:
            p.fail(f"{where}.from_step", f"must be below the workload's {steps} steps, got {step}")
        if step <= last:
            p.fail(f"{where}.from_step", f"must be after the previous entry's ({last}), got {step}")
        last = step
        kw: dict[str, Any] = {"from_step": step}
        for k in ("tokens_per_call", "tasks_per_step", "samples_per_task"):
            if k in c:
                kw[k] = p.integer(c, k, where, positive=True)
        if "tool_output_tokens" in c:
            kw["tool_output_tokens"] = p.integer(c, "tool_output_tokens", where, positive=False)
        if "tokens_per_execution" in c:
            kw["tokens_per_execution"] = p.dist(c["tokens_per_execution"], f"{where}.tokens_per_execution", "")
        if "tool_latency" in c:
            kw["tool_latency"] = p.dist(c["tool_latency"], f"{where}.tool_latency", _LATENCY_SUFFIX)
        if "train_share" in c:
            kw["train_share"] = p.share(c, "train_share", where)
        if len(kw) == 1:
            p.fail(where, "changes nothing (give at least one field besides from_step)")
        out.append(StepChange(**kw))
    return tuple(out)


def _timeline(p: "_Parser", value: Any, cells: int) -> tuple[CellEvent, ...]:
    out, last = [], -math.inf
    alive = {cell_name(i) for i in range(cells)}
    joined = cells
    for i, raw in enumerate(p.items(value, "timeline")):
        where = f"timeline[{i}]"
        e = p.obj(raw, where)
        p.no_unknown(e, {"at", "join", "leave"}, where)
        at = p.num(e, "at", where, positive=False)
        if at < last:
            p.fail(f"{where}.at", f"must not be before the previous entry's ({last:g}), got {at:g}")
        last = at
        join = p.integer(e, "join", where, positive=False) if "join" in e else 0
        leave = e.get("leave", [])
        if not isinstance(leave, list) or not all(isinstance(n, str) for n in leave):
            p.fail(f"{where}.leave", "must be a list of cell names")
        if len(set(leave)) < len(leave):
            twice = sorted({n for n in leave if leave.count(n) > 1})
            p.fail(f"{where}.leave", f"names {twice[0]!r} more than once")
        for name in leave:
            if name not in alive:
                p.fail(f"{where}.leave", f"names {name!r}, which is no cell at {at:g} s (cells then: "
                                         f"{', '.join(sorted(alive, key=lambda n: int(n.split('-')[1])))})")
            alive.discard(name)
        alive |= {cell_name(joined + k) for k in range(join)}
        joined += join
        if not join and not leave:
            p.fail(where, "neither joins nor leaves a cell")
        if not alive:
            p.fail(f"{where}.leave", "leaves the cluster without a cell")
        out.append(CellEvent(at=at, join=join, leave=tuple(leave)))
    return tuple(out)


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

    def share(self, d: dict, key: str, prefix: str) -> float:
        v = self.num(d, key, prefix, positive=False)
        if not v < 1.0:
            self.fail(self._path(prefix, key), f"must be below 1, got {v}")
        return v

    def num(self, d: dict, key: str, prefix: str, *, positive: bool,
            within: tuple[float, float] | None = None) -> float:
        field = self._path(prefix, key)
        v = self.required(d, key, prefix)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(field, f"must be a number, got {type(v).__name__}")
        try:
            v = float(v)
        except OverflowError:
            self.fail(field, "is out of range (an integer too large for a float)")
        if not math.isfinite(v):
            self.fail(field, f"must be finite, got {v}")
        if positive and v <= 0:
            self.fail(field, f"must be positive, got {v}")
        if not positive and v < 0:
            self.fail(field, f"must not be negative, got {v}")
        if within is not None and not within[0] <= v <= within[1]:
            self.fail(field, f"must be between {within[0]:g} and {within[1]:g}, got {v:g}")
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

    def items(self, value: Any, where: str) -> list:
        if not isinstance(value, list):
            self.fail(where, f"must be a list, got {type(value).__name__}")
        return value

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
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise WorkloadError(f"{text_source}: cannot be read as UTF-8 text: {err}") from None
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
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as err:
        raise WorkloadError(f"{text_source}: not valid JSON: {err}") from None
    except _DuplicateKey as err:
        raise WorkloadError(f"{text_source}: field {err.args[0]!r} is given more than once") from None
    return workload_from_dict(data, source=text_source)


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(k)
        out[k] = v
    return out


