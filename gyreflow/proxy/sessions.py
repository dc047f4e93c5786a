"""Sessions: one per execution, each with its own secret, budget and records.

A session's calls are recorded only once their response reached the agent. The official SDK
retries a failed request with the same body (up to three arrivals); a retry of a call that is
still running joins it, and a retry of a call whose response was lost (or that says it is a retry)
gets the same response again: one engine call, one record.
"""

from __future__ import annotations

import asyncio
import hmac
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import numpy as np

from gyreflow.engine.base import GenerationRequest, GenerationResult
from gyreflow.proxy.errors import ApiError
from gyreflow.trajectory.records import CallRecord

Generate = Callable[[GenerationRequest], Awaitable[GenerationResult]]
SESSION_ID = re.compile(r"^[A-Za-z0-9_.:@=+-]{1,200}$")
"""Execution ids a session may have: they appear in its base URL."""


@dataclass(frozen=True)
class Budget:
    """What one execution may spend through the proxy; past it, calls are refused (HTTP 429,
    not to be retried)."""

    max_calls: int = 1000
    """Model calls."""
    token_budget: int = 1 << 20
    """Generated tokens, all calls together; a call's ``max_tokens`` is cut to what is left."""
    time_limit_s: float = 3600.0
    """Seconds from the session's opening."""
    max_tokens_per_call: int = 1024
    """Completion length when a request names none (and the most it may name)."""
    max_inflight: int = 8
    """Calls of the session running at once; more are refused with a retryable 429."""

    def __post_init__(self) -> None:
        for name in ("max_calls", "token_budget", "max_tokens_per_call", "max_inflight"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Budget.{name} must be at least 1, got {getattr(self, name)}")
        if self.time_limit_s <= 0:
            raise ValueError(f"Budget.time_limit_s must be positive, got {self.time_limit_s}")


@dataclass(frozen=True)
class SamplingPin:
    """Sampling settings a session imposes on every call, whatever the program asks (``None``: as
    asked). A training session pins the run's settings so that every call is a trainable sample."""

    temperature: float | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature is not None and not 0 < self.temperature <= 2:
            raise ValueError(f"SamplingPin.temperature must be in (0, 2], got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingPin.top_p must be in (0, 1], got {self.top_p}")

    def apply(self, temperature: float, top_p: float) -> tuple[float, float]:
        """The settings a call asking for ``temperature`` and ``top_p`` is sampled with."""
        return (temperature if self.temperature is None else self.temperature,
                top_p if self.top_p is None else self.top_p)


@dataclass
class Reply:
    """One engine call and everything needed to answer it again."""

    key: str
    """Hash of the request body: an identical retry finds this reply."""
    done: asyncio.Future
    """Resolves (to this reply) when the engine's result is in, or with the call's error."""
    call_index: int = -1
    request_id: str = ""
    """The engine request's id (the reply's id is derived from it)."""
    result: GenerationResult | None = None
    prompt_ids: np.ndarray | None = None
    turn_ids: np.ndarray | None = None
    """Forced prefix and completion ids: the assistant turn as the model produced it."""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str = "stop"
    response_id: str = ""
    created: int = 0
    role: str = ""
    t_start: float = 0.0
    t_end: float = 0.0
    temperature: float = 1.0
    top_p: float = 1.0
    """Sampling settings the call was served with."""
    delivered: bool = False
    recorded: bool = False


class Session:
    """The proxy's view of one execution."""

    def __init__(self, execution_id: str, secret: str, generate: Generate, budget: Budget, seed: int = 0,
                 role: str = "", pin: SamplingPin | None = None) -> None:
        self.execution_id = execution_id
        self.pin = pin or SamplingPin()
        self.secret = secret
        self.generate = generate
        self.budget = budget
        self.seed = seed
        self.role = role
        self.opened = time.monotonic()
        self.closed = False
        self.records: list[CallRecord] = []
        self.calls_started = 0
        """Engine calls made: the next call's index (its request id and seed)."""
        self.calls_charged = 0
        """Calls the budget counts: those started, less those the engine refused outright."""
        self.tokens_generated = 0
        self.tokens_reserved = 0
        """``max_tokens`` of the calls running: what they may still generate."""
        self.inflight = 0
        self.refused: dict[str, int] = {}
        self.engine_failures = 0
        """Calls that failed on the engine's side (5xx): an infrastructure failure, not the agent's."""
        self.replies: OrderedDict[str, Reply] = OrderedDict()
        self.turns: dict[object, tuple[frozenset, np.ndarray]] = {}
        """Raw payload cache: tool-call id, or ``("text", content)``, -> (the turn's call ids, the
        turn's exact ids)."""
        self.conversations: dict[str, list[dict]] = {}
        """Responses API: response id -> the whole conversation through that response."""

    # -- budget -------------------------------------------------------------------------------

    def admit(self) -> None:
        """Refuse a new engine call that the budget does not allow."""
        b = self.budget
        reason = None
        if self.closed:
            raise ApiError(401, "unknown or finished session", type="authentication_error", code="invalid_api_key",
                           retry=False)
        if self.calls_charged >= b.max_calls:
            reason = f"the execution's {b.max_calls} model calls are spent"
        elif self.tokens_generated + self.tokens_reserved >= b.token_budget:
            reason = f"the execution's budget of {b.token_budget} generated tokens is spent"
        elif time.monotonic() - self.opened > b.time_limit_s:
            reason = f"the execution's time limit of {b.time_limit_s:g} s has passed"
        if reason:
            self.refused["budget"] = self.refused.get("budget", 0) + 1
            raise ApiError(429, reason, type="insufficient_quota", code="budget_exhausted", retry=False)
        if self.inflight >= b.max_inflight:
            self.refused["inflight"] = self.refused.get("inflight", 0) + 1
            raise ApiError(429, f"more than {b.max_inflight} calls of this execution at once",
                           type="rate_limit_exceeded", code="rate_limit_exceeded", retry=True)

    def max_tokens(self, requested: int | None) -> int:
        """A new call's ``max_tokens``: what it asked for, cut to what the budget has left once the
        running calls have what they may still generate."""
        left = self.budget.token_budget - self.tokens_generated - self.tokens_reserved
        cap = min(self.budget.max_tokens_per_call, left)
        return max(1, min(requested or cap, cap))

    # -- retries ------------------------------------------------------------------------------

    def existing(self, key: str, retry: bool) -> Reply | None:
        """The reply an identical request should get again, if this request is a retry: one that
        says so, or one whose earlier reply finished but never reached the client. Identical
        requests sent at once without the retry mark are separate samples (best-of-n)."""
        reply = self.replies.get(key)
        if reply is None:
            return None
        if retry or (reply.done.done() and not reply.done.exception() and not reply.delivered):
            return reply
        return None

    def remember(self, reply: Reply, keep: int = 64) -> None:
        self.replies[reply.key] = reply
        self.replies.move_to_end(reply.key)
        while len(self.replies) > keep:
            self.replies.popitem(last=False)

    # -- records ------------------------------------------------------------------------------

    def delivered(self, reply: Reply) -> None:
        """The agent has the reply: record its call (once), and cache its turn for restoring."""
        reply.delivered = True
        if reply.recorded or reply.result is None or self.closed:
            return
        reply.recorded = True
        r = reply.result
        self.records.append(CallRecord(
            execution_id=self.execution_id, call_index=len(self.records), call_id=r.request_id, role=reply.role,
            prompt_ids=reply.prompt_ids, completion_ids=r.completion_ids, logprobs=r.logprobs, versions=r.versions,
            finish_reason=r.finish_reason, engine=r.engine, t_start=reply.t_start, t_end=reply.t_end,
            temperature=reply.temperature, top_p=reply.top_p))
        ids = frozenset(call["id"] for call in reply.tool_calls)
        for call in reply.tool_calls:
            self.turns[call["id"]] = (ids, reply.turn_ids)
        if not reply.tool_calls:
            self.turns[("text", reply.content)] = (frozenset(), reply.turn_ids)

    def restored_turns(self, messages: list[dict]) -> dict[int, np.ndarray]:
        """Assistant messages of ``messages`` that are turns this session served, by index."""
        out = {}
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            calls = m.get("tool_calls") or []
            if calls:
                # Only a message that holds exactly the calls of one served turn is that turn; a
                # turn's parallel calls split over messages are rendered as sent.
                hit = self.turns.get(calls[0]["id"])
                if hit is not None and hit[0] == frozenset(c["id"] for c in calls):
                    out[i] = hit[1]
            elif ("text", m["content"]) in self.turns:
                out[i] = self.turns[("text", m["content"])][1]
        return out


class SessionRegistry:
    """The open sessions of one proxy; the only way in is a session's secret."""

    def __init__(self) -> None:
        self._by_id: dict[str, Session] = {}
        self._by_secret: dict[str, Session] = {}

    def open(self, execution_id: str, generate: Generate, *, budget: Budget | None = None, seed: int = 0,
             role: str = "", pin: SamplingPin | None = None) -> Session:
        if not SESSION_ID.match(execution_id):
            raise ValueError(f"execution id {execution_id!r} cannot name a session: it must match {SESSION_ID.pattern}")
        if execution_id in self._by_id:
            raise ValueError(f"a session for execution {execution_id!r} is already open")
        s = Session(execution_id, "gf-" + secrets.token_urlsafe(24), generate, budget or Budget(), seed, role, pin)
        self._by_id[execution_id] = s
        self._by_secret[s.secret] = s
        return s

    def close(self, execution_id: str) -> Session:
        """End a session: later requests with its key are refused; its records are final."""
        s = self._by_id.pop(execution_id)
        self._by_secret.pop(s.secret, None)
        s.closed = True
        return s

    def __contains__(self, execution_id: str) -> bool:
        return execution_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def sessions(self) -> list[Session]:
        return list(self._by_id.values())

    def authenticate(self, path_session: str | None, authorization: str | None, api_key: str | None = None) -> Session:
        """The session a request belongs to: by its key, and (when the base URL names one) the
        named session only, so one session's key never reaches another's records."""
        key = api_key
        if authorization and authorization.lower().startswith("bearer "):
            key = authorization[7:].strip()
        unknown = ApiError(401, "unknown or finished session: check the base URL and API key of this execution",
                           type="authentication_error", code="invalid_api_key", retry=False)
        s = self._by_secret.get(key or "")
        if s is None:
            raise unknown
        if path_session is not None and not hmac.compare_digest(path_session, s.execution_id):
            raise unknown
        return s
