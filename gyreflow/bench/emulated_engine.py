"""An engine whose compute is the benchmark's cost model: it waits the modelled time, moves modelled bytes.

:class:`EmulatedEngine` offers the surface of :class:`~gyreflow.engine.torch_engine.TorchEngine`
that :class:`~gyreflow.engine.runner.EngineRunner`, the engine service and migration use
(``submit``, ``step``, ``has_work``, ``wait_for_work``, ``wake``, ``load_weights``,
``export_request``, ``import_request``, ``stats``), so the real cluster, router and pipeline code
run on top of it unchanged; only the tokens are counts instead of ids.

Emulated wire format
--------------------
A request stands for one model call of an emulated execution:

- ``prompt_ids`` is ``np.array([context_tokens], int32)``: the length, in tokens, of the call's
  whole prompt (everything before it in the session plus its new tokens);
- ``params.max_tokens`` is how many tokens the call generates; it always generates exactly that
  many (``finish_reason`` ``"length"``; other sampling parameters are ignored);
- ``session`` keys a per-session cached context length in this engine: the call prefills only
  ``context_tokens - cached`` tokens, and afterwards the session's cached length is
  ``context_tokens + generated``.

The result has ``completion_ids = np.array([n_generated], int32)`` (all tokens of the call,
including those made before a migration), ``logprobs = np.zeros(1, float32)``,
``versions = np.array([weights version at its last token], int32)``, ``prompt_ids`` echoed,
``engine`` = the engine's name, ``prefix_reused`` = the cached part of the prompt, and
``received_at`` / ``finished_at`` = the real times it was submitted here (None if imported) and its
modelled completion happened (the result is handed out at the next ``step``, a little later).

An exported request (:class:`~gyreflow.engine.base.LiveRequestState`) has
``completion_ids = np.array([tokens_done])``, 1-element ``logprobs``/``versions``, an empty
``generator_state`` and ``kv`` = ``cached_tokens * kv_bytes_per_token`` real zero bytes (context and
tokens done for a live generation; 0 for one that had not been admitted), so moving it between
workers costs a real transfer of that size.

Timing (emulated seconds; ``time_scale`` of them pass per wall-clock second)
----------------------------------------------------------------------------
A fluid model of the cost model, advanced by the real elapsed time (``time.time``; sleeps that
overshoot are credited, so the emulation does not drift slow):

- at most ``max_batch`` requests are live; more wait in FIFO order (imported ones go first);
- an admitted request first prefills its uncached tokens at ``c`` per token; the whole cell spends
  that time (prefill is batched with decode, so live generations are delayed by it), in admission
  order;
- otherwise the ``k`` decoding requests advance together, one token each per ``a + b*k``;
- an imported request waits ``handoff_s`` (only it, not the cell) before it may be admitted; it
  needs no prefill for the tokens its KV covers.

``busy_s`` counts emulated seconds with a prefill or at least one generation in progress;
``mean_resolve_lag_s`` / ``max_resolve_lag_s`` say how late (emulated) results were handed out
after their modelled completion, i.e. how faithfully a loaded machine kept up. Events
(completions, prefill ends, hand-offs, admissions) are processed at their exact emulated times
within a step, so the outcome does not depend on how often ``step`` runs; ``step`` sleeps at most
``quantum_s`` of real time and is woken at once by new requests.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np

from gyreflow.bench.workload import Cost, Workload, emulated_tokens_bytes
from gyreflow.engine.base import (
    GenerationRequest,
    GenerationResult,
    LiveRequestState,
    IMPORTED_PRIORITY,
    RequestExported,
    SamplingParams,
    WorkSignal,
    take_next,
)

_TOKEN_EPS = 1e-6
"""Fractional tokens below which a count is taken as reached (float bookkeeping)."""


@dataclass(eq=False)
class _Req:
    """Mutable state of one request inside the emulated engine."""

    request_id: str
    context: int
    """Prompt tokens."""
    tokens: int
    """Tokens to generate in all (``params.max_tokens``)."""
    params: SamplingParams
    session: str | None
    future: Future
    version: int
    """Weights version of its latest token."""
    done: float = 0.0
    """Tokens generated so far (fractional while in progress)."""
    kv_tokens: int = 0
    """Tokens of its sequence whose KV it holds: brought by an import, or set on admission."""
    prefill_left: float = 0.0
    """Tokens still to prefill (live requests only)."""
    prefix_reused: int = 0
    ready_at: float = 0.0
    """Emulated time its hand-off ends (imported requests)."""
    priority: float = 0.0
    """Admission order (see :attr:`GenerationRequest.priority`)."""
    received_at: float | None = None
    """Real time it was submitted here (None if imported)."""

    @property
    def seq_tokens(self) -> int:
        """Prompt plus whole tokens generated."""
        return self.context + int(math.floor(self.done + _TOKEN_EPS))


class EmulatedEngine(WorkSignal):
    """An engine that emulates a rollout cell by the cost model (see the module docstring).

    Parameters
    ----------
    cost
        The cost model: a :class:`~gyreflow.bench.workload.Workload` or its
        :class:`~gyreflow.bench.workload.Cost`.
    time_scale
        Emulated seconds per wall-clock second; defaults to the workload's when ``cost`` is one.
    name
        Written into every result's ``engine`` field (the worker address on a cell).
    version
        Initial weights version.
    quantum_s
        Longest real sleep of one ``step``. New requests, exports and :meth:`wake` interrupt the
        sleep at once, and the sleep never passes the next completion, so this only bounds how
        long a step may take.
    clock
        Source of real time in seconds (``time.time`` by default, so that the times results carry
        compare across processes); tests pass a fake one to step the emulation deterministically.
    """

    def __init__(
        self,
        cost: Cost | Workload,
        *,
        time_scale: float | None = None,
        name: str = "emulated",
        version: int = 0,
        quantum_s: float = 0.02,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if isinstance(cost, Workload):
            time_scale = cost.time_scale if time_scale is None else time_scale
            cost = cost.cost
        if not isinstance(cost, Cost):
            raise TypeError(f"cost must be a Workload or a Cost, got {type(cost).__name__}")
        if time_scale is None or not time_scale > 0:
            raise ValueError(f"time_scale must be positive, got {time_scale}")
        if not quantum_s > 0:
            raise ValueError(f"quantum_s must be positive, got {quantum_s}")
        self.cost = cost
        self.time_scale = float(time_scale)
        self.name = name
        self.version = int(version)
        self.max_batch = int(cost.max_batch)
        self.quantum_s = float(quantum_s)
        self._real_clock = clock or time.time

        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._waiting: deque[_Req] = deque()
        self._arriving: list[_Req] = []  # imported, in hand-off
        self._live: list[_Req] = []  # admission order
        self._ids: dict[str, _Req] = {}
        self._sessions: dict[str, int] = {}
        self._staged: int | None = None
        self._done: list[tuple[Future, GenerationResult, float]] = []  # with the emulated finish time
        self._clock = 0.0
        self._last_real: float | None = None
        self._counters = dict(
            tokens_generated=0.0,
            busy_s=0.0,
            prefill_tokens=0.0,
            reused_tokens=0,
            submitted=0,
            finished=0,
            exported=0,
            imported=0,
            steps=0,
            resolve_lag_s=0.0,
            max_resolve_lag_s=0.0,
        )

    # ------------------------------------------------------------------ requests in

    def submit(self, request: GenerationRequest) -> Future:
        """Queue a request (emulated wire format); the future resolves to its :class:`GenerationResult`.

        Raises
        ------
        ValueError
            A prompt that is not ``[context_tokens]``, ``max_tokens < 1``, or a request with this
            id already in the engine.
        """
        context = self._context(request.request_id, request.prompt_ids)
        if request.params.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: max_tokens must be at least 1")
        req = _Req(
            request.request_id, context, int(request.params.max_tokens), request.params, request.session,
            Future(), self.version, priority=float(request.priority),
        )  # fmt: skip
        with self._work:
            self._sync()  # time so far belongs to the requests already here
            req.received_at = self._last_real
            self._register(req)
            self._waiting.append(req)
            self._counters["submitted"] += 1
            self._work.notify_all()
        return req.future

    def import_request(self, state: LiveRequestState, on_token=None) -> Future:
        """Resume a request exported by :meth:`export_request` (of this or another emulated engine).

        It waits ``handoff_s`` (emulated; only it), then goes ahead of requests that never started;
        its KV covers ``state.kv.size // kv_bytes_per_token`` tokens, which it does not prefill
        again. The future resolves to the full result, counting the tokens made before the move.
        Emulated tokens are not streamed: ``on_token`` is never called, here or in :meth:`submit`.
        """
        context = self._context(state.request_id, state.prompt_ids)
        completion = np.asarray(state.completion_ids).reshape(-1)
        done = int(completion[0]) if completion.size else 0
        if state.params.max_tokens <= done:
            raise ValueError(f"request {state.request_id!r} is already complete ({done} tokens)")
        versions = np.asarray(state.versions).reshape(-1)
        req = _Req(
            state.request_id,
            context,
            int(state.params.max_tokens),
            state.params,
            state.session,
            Future(),
            int(versions[-1]) if versions.size else int(state.source_version),
            done=float(done),
            kv_tokens=int(np.asarray(state.kv).nbytes // self.cost.kv_bytes_per_token),
            prefix_reused=int(state.prefix_reused),
            priority=IMPORTED_PRIORITY,
        )
        with self._work:
            self._sync()
            self._register(req)
            req.ready_at = self._clock + self.cost.handoff_s
            if self.cost.handoff_s > 0:
                self._arriving.append(req)
            else:
                self._waiting.appendleft(req)
            self._counters["imported"] += 1
            self._work.notify_all()
        return req.future

    @staticmethod
    def _context(request_id: str, prompt_ids) -> int:
        prompt = np.asarray(prompt_ids).reshape(-1)
        if prompt.size != 1 or int(prompt[0]) < 1:
            raise ValueError(
                f"request {request_id!r}: an emulated prompt is np.array([context_tokens]) with context_tokens >= 1, "
                f"got {prompt.size} ids"
            )
        return int(prompt[0])

    def _register(self, req: _Req) -> None:
        if req.request_id in self._ids:
            raise ValueError(f"request {req.request_id!r} is already in this engine")
        self._ids[req.request_id] = req

    # ------------------------------------------------------------------ requests out

    def export_request(self, request_id: str) -> LiveRequestState:
        """Take a waiting, arriving or live request out of this engine, as of now.

        Its ``submit`` (or ``import_request``) future resolves with :class:`RequestExported`. A live
        request's session cache leaves with it.

        Raises
        ------
        KeyError
            No such request here (never submitted, finished, or already exported).
        """
        with self._work:
            self._sync()
            req = self._ids.pop(request_id, None)
            if req is None:
                raise KeyError(f"no request {request_id!r} in engine {self.name}")
            if req in self._waiting:
                self._waiting.remove(req)
                kv_tokens = req.kv_tokens
            elif req in self._arriving:
                self._arriving.remove(req)
                kv_tokens = req.kv_tokens
            else:
                self._live.remove(req)
                kv_tokens = req.seq_tokens - int(math.ceil(req.prefill_left - _TOKEN_EPS))
                if req.session is not None:
                    self._sessions.pop(req.session, None)
            self._counters["exported"] += 1
            self._work.notify_all()
        state = LiveRequestState(
            request_id=req.request_id,
            prompt_ids=np.array([req.context], dtype=np.int32),
            completion_ids=np.array([int(math.floor(req.done + _TOKEN_EPS))], dtype=np.int32),
            logprobs=np.zeros(1, dtype=np.float32),
            versions=np.array([req.version], dtype=np.int32),
            params=req.params,
            session=req.session,
            generator_state=np.zeros(0, dtype=np.uint8),
            kv=emulated_tokens_bytes(max(0, kv_tokens), self.cost.kv_bytes_per_token),
            prefix_reused=req.prefix_reused,
            source=self.name,
            source_version=self.version,
        )
        req.future.set_exception(RequestExported(request_id))
        return state

    def request_ids(self) -> list[str]:
        """Ids of the requests in this engine, live, waiting or arriving (what a migration moves)."""
        with self._lock:
            return list(self._ids)

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights, version: int) -> None:
        """Stage weights ``version`` (the arrays are ignored); it applies at the next step."""
        with self._work:
            self._staged = int(version)
            self._work.notify_all()

    # ------------------------------------------------------------------ the loop

    def has_work(self) -> bool:
        """Whether ``step`` would do anything: live, waiting or arriving requests, or staged weights."""
        return bool(self._live or self._waiting or self._arriving or self._staged is not None)

    def step(self) -> int:
        """Catch up with the real clock, apply staged weights, then sleep until the next event.

        The sleep lasts at most ``quantum_s`` real seconds and ends early on new requests,
        exports, staged weights or :meth:`wake`; the time actually slept is credited.

        Returns
        -------
        int
            Tokens generated during this step (whole tokens of the running total).
        """
        with self._work:
            before = self._counters["tokens_generated"]
            self._sync()
            if self._staged is not None:
                self.version, self._staged = self._staged, None
            horizon = self._horizon()
            if math.isfinite(horizon):
                pause = min(self.quantum_s, horizon / self.time_scale)
                if pause > 0:
                    self._work.wait(pause)
                self._sync()
            self._counters["steps"] += 1
            produced = int(self._counters["tokens_generated"] + _TOKEN_EPS) - int(before + _TOKEN_EPS)
            done, self._done = self._done, []
            for _, result, finished_at in done:
                lag = self._clock - finished_at
                self._counters["resolve_lag_s"] += lag
                self._counters["max_resolve_lag_s"] = max(self._counters["max_resolve_lag_s"], lag)
                result.finished_at = self._last_real - lag / self.time_scale  # real time of the modelled end
        for fut, result, _ in done:  # outside the lock: callbacks may submit or export
            fut.set_result(result)
        return produced

    def drain(self, max_steps: int | None = None) -> int:
        """Step until no work is left (or ``max_steps``); return tokens generated."""
        total, n = 0, 0
        while self.has_work() and (max_steps is None or n < max_steps):
            total += self.step()
            n += 1
        return total

    # ------------------------------------------------------------------ the fluid model (lock held)

    def _sync(self) -> None:
        """Advance the emulation by the real time elapsed since the last advance."""
        now = self._real_clock()
        if self._last_real is None:
            self._last_real = now
        dt = max(0.0, now - self._last_real) * self.time_scale
        self._last_real = now
        self._run(dt)

    def _horizon(self) -> float:
        """Emulated seconds to the next event (prefill end, completion, hand-off end); inf if none."""
        h = math.inf
        pre = next((r for r in self._live if r.prefill_left > 0), None)
        if pre is not None:
            h = pre.prefill_left * self.cost.c
        elif self._live:
            it = self.cost.iteration_s(len(self._live))
            h = min(r.tokens - r.done for r in self._live) * it
        if self._arriving:
            h = min(h, min(r.ready_at for r in self._arriving) - self._clock)
        return max(0.0, h)

    def _run(self, dt: float) -> None:
        """Advance the emulated clock by ``dt``, handling every event at its exact time."""
        cost = self.cost
        while True:
            self._release_arrivals()
            self._admit()
            pre = next((r for r in self._live if r.prefill_left > 0), None)
            dec = self._live if pre is None else []
            h_cell, first = math.inf, None
            if pre is not None:
                h_cell = pre.prefill_left * cost.c
            elif dec:
                it = cost.iteration_s(len(dec))
                first = min(dec, key=lambda r: r.tokens - r.done)
                h_cell = max(0.0, first.tokens - first.done) * it
            h_arr = min(r.ready_at for r in self._arriving) - self._clock if self._arriving else math.inf
            h = max(0.0, min(dt, h_cell, h_arr))
            if h > 0:
                if pre is not None:
                    n = min(pre.prefill_left, h / cost.c)
                    pre.prefill_left -= n
                    self._counters["prefill_tokens"] += n
                elif dec:
                    inc = h / it
                    for r in dec:
                        r.done = min(float(r.tokens), r.done + inc)
                        r.version = self.version
                    self._counters["tokens_generated"] += inc * len(dec)
                if pre is not None or dec:
                    self._counters["busy_s"] += h
                self._clock += h
                dt -= h
            event = False
            if pre is not None and (h >= h_cell or pre.prefill_left <= _TOKEN_EPS):
                pre.prefill_left = 0.0
                event = True
            if first is not None and h >= h_cell:
                first.done = float(first.tokens)
            finished = [r for r in dec if r.done >= r.tokens - _TOKEN_EPS]
            for r in finished:
                self._finish(r)
                event = True
            if self._arriving and h >= h_arr:
                self._release_arrivals(force=True)
                event = True
            if not event and dt <= 1e-12:
                return

    def _release_arrivals(self, force: bool = False) -> None:
        """Move requests whose hand-off has ended to the front of the queue (earliest first)."""
        if not self._arriving:
            return
        limit = self._clock + 1e-9
        if force:
            limit = max(limit, min(r.ready_at for r in self._arriving))
        ready = sorted((r for r in self._arriving if r.ready_at <= limit), key=lambda r: r.ready_at)
        for r in ready:
            self._arriving.remove(r)
        self._waiting.extendleft(reversed(ready))

    def _admit(self) -> None:
        while self._waiting and len(self._live) < self.max_batch:
            r = take_next(self._waiting)
            seq = r.seq_tokens
            if r.kv_tokens == 0 and r.session is not None and r.done == 0:
                reuse = min(self._sessions.get(r.session, 0), r.context)
                if reuse:
                    r.prefix_reused = reuse
                    self._counters["reused_tokens"] += reuse
                r.kv_tokens = reuse
            cached = min(r.kv_tokens, seq)
            r.prefill_left = float(seq - cached) if self.cost.c > 0 else 0.0
            if self.cost.c <= 0:
                self._counters["prefill_tokens"] += seq - cached
            self._live.append(r)

    def _finish(self, r: _Req) -> None:
        self._live.remove(r)
        self._ids.pop(r.request_id, None)
        if r.session is not None:
            self._sessions[r.session] = r.context + r.tokens
        self._counters["finished"] += 1
        result = GenerationResult(
            request_id=r.request_id,
            prompt_ids=np.array([r.context], dtype=np.int32),
            completion_ids=np.array([r.tokens], dtype=np.int32),
            logprobs=np.zeros(1, dtype=np.float32),
            versions=np.array([r.version], dtype=np.int32),
            finish_reason="length",
            engine=self.name,
            prefix_reused=r.prefix_reused,
            received_at=r.received_at,
        )
        self._done.append((r.future, result, self._clock))

    # ------------------------------------------------------------------ introspection

    def now(self) -> float:
        """The emulated clock (seconds since this engine was made, as of its last advance)."""
        with self._lock:
            return self._clock

    def stats(self) -> dict:
        """Counters and occupancy: live, waiting, version, tokens generated, busy_s (emulated), ..."""
        with self._lock:
            c = self._counters
            return dict(
                name=self.name,
                emulated=True,
                live=len(self._live),
                waiting=len(self._waiting),
                arriving=len(self._arriving),
                version=self.version,
                staged_version=self._staged,
                max_batch=self.max_batch,
                tokens_generated=int(c["tokens_generated"] + _TOKEN_EPS),
                busy_s=c["busy_s"],
                clock_s=self._clock,
                prefill_tokens=int(c["prefill_tokens"] + _TOKEN_EPS),
                reused_tokens=c["reused_tokens"],
                submitted=c["submitted"],
                finished=c["finished"],
                exported=c["exported"],
                imported=c["imported"],
                steps=c["steps"],
                mean_resolve_lag_s=c["resolve_lag_s"] / c["finished"] if c["finished"] else 0.0,
                max_resolve_lag_s=c["max_resolve_lag_s"],
                sessions=len(self._sessions),
                time_scale=self.time_scale,
            )

    def __repr__(self) -> str:
        return f"EmulatedEngine(name={self.name!r}, version={self.version}, live={len(self._live)})"


def emulated_engine_factory(
    hf_config, weights, version: int, name: str, *, workload: Workload | Cost | str, time_scale: float | None = None,
    quantum_s: float = 0.02,
) -> EmulatedEngine:  # fmt: skip
    """An engine factory for :class:`~gyreflow.engine.service.EngineService`: an :class:`EmulatedEngine`.

    ``hf_config`` and ``weights`` are ignored; ``workload`` is a :class:`Workload` (or its name or
    path, or a bare :class:`Cost` with ``time_scale``); pass it and the rest through the service's
    ``engine_options``.
    """
    if isinstance(workload, str):
        from gyreflow.bench.workload_file import load_workload

        workload = load_workload(workload)
    return EmulatedEngine(workload, time_scale=time_scale, name=name, version=version, quantum_s=quantum_s)
