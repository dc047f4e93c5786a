"""The engine interface: requests, results, live-request state and the Engine protocol."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion."""

    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass, in (0, 1]."""
    max_tokens: int = 64
    """Most tokens to sample."""
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends once the completion's text ends with one (it is kept)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the completion (kept as its last token), e.g. ``<|end|>``."""
    seed: int | None = None
    """Seed of this request's own random generator; ``None`` draws one."""
    constraint: str | None = None
    """A template the completion must follow, as JSON (:mod:`gyreflow.engine.constraints`);
    tokens that cannot follow it are masked before sampling."""


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: np.ndarray  # (P,) int32
    params: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None
    """Requests of one session may reuse the KV cache of that session's previous request."""
    priority: float = 0.0
    """Admission order when requests wait for a batch slot: lower first, ties in arrival order.
    The router passes its execution's start time, so an older execution's call (likely one of the
    long tail a step waits for) never queues behind a younger execution's."""
    on_token: Callable[[int, float], None] | None = field(default=None, repr=False, compare=False)
    """Called with (token id, log-prob) as each token is sampled, on the engine's thread (keep it
    short). It stays in the process that submitted the request: the wire format and an exported
    request's state leave it out; the router relays an engine's tokens to it over Dask
    (:mod:`gyreflow.engine.streams`), on the caller's event loop."""


class WorkSignal:
    """``wait_for_work``/``wake`` for an engine that keeps a ``threading.Condition`` as ``_work``
    and says whether it has work in ``has_work()`` (what :class:`~gyreflow.engine.runner.EngineRunner`
    needs besides the :class:`Engine` protocol)."""

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until there is work, :meth:`wake` or ``timeout``; whether there is work."""
        with self._work:
            if self.has_work():
                return True
            self._work.wait(timeout)
            return self.has_work()

    def wake(self) -> None:
        """Wake every thread waiting on the engine."""
        with self._work:
            self._work.notify_all()


IMPORTED_PRIORITY = float("-inf")
"""A migrated request goes ahead of every request that never started."""


def take_next(waiting):
    """Remove and return the waiting request to admit next: the lowest ``priority``, the earliest
    among equals (``waiting`` is a deque in arrival order)."""
    best = min(waiting, key=lambda r: r.priority)
    waiting.remove(best)
    return best


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: np.ndarray  # (P,) int32, exactly as consumed
    completion_ids: np.ndarray  # (C,) int32
    logprobs: np.ndarray  # (C,) float32, behaviour log-probs under the sampling temperature
    versions: np.ndarray  # (C,) int32, weights version that produced each token
    finish_reason: str  # "stop" | "length"
    engine: str = ""
    prefix_reused: int = 0
    received_at: float | None = None
    """Wall time (``time.time()``) the engine that finished it took it in; None if it came by import."""
    finished_at: float | None = None
    """Wall time its last token was made (an emulated engine: the modelled time, which it may hand
    out a little later)."""


class RequestExported(Exception):
    """The request left this engine by :meth:`Engine.export_request`.

    The future that ``submit`` returned for it resolves with this exception; the request goes on
    in whatever engine imports its :class:`LiveRequestState` (under the same ``request_id``).
    """

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} was exported from this engine")
        self.request_id = request_id


@dataclass
class LiveRequestState:
    """A request in flight, as plain data: enough to resume it exactly in another engine.

    Holds numpy arrays, ints, strings and bytes only, so it pickles without torch and can travel
    through Dask. Resuming with the same weights continues to the very tokens and log-probs the
    request would have produced had it never moved.
    """

    request_id: str
    prompt_ids: np.ndarray  # (P,) int32
    completion_ids: np.ndarray  # (C,) int32, sampled so far
    logprobs: np.ndarray  # (C,) float32
    versions: np.ndarray  # (C,) int32
    params: SamplingParams
    session: str | None
    generator_state: np.ndarray  # (G,) uint8, ``torch.Generator.get_state()`` of its sampler
    kv: np.ndarray  # (L, 2, Hkv, N, Dh) float32: keys and values of its first N tokens
    """N = tokens whose KV is cached: ``P + C - 1`` in flight (the last sampled token is not yet
    fed), 0 when it had not been admitted yet."""
    prefix_reused: int = 0
    source: str = ""
    """Name of the engine it left."""
    source_version: int = 0
    """That engine's weights version when it left."""

    @property
    def num_cached(self) -> int:
        return int(self.kv.shape[3]) if self.kv.ndim == 5 else 0


@runtime_checkable
class Engine(Protocol):
    """A model replica that serves generation requests with continuous batching."""

    version: int

    def submit(self, request: GenerationRequest) -> Future: ...

    def step(self) -> int: ...

    def load_weights(self, weights: dict[str, np.ndarray], version: int) -> None: ...

    def export_request(self, request_id: str) -> LiveRequestState: ...

    def request_ids(self) -> list[str]: ...

    def import_request(self, state: LiveRequestState,
                       on_token: Callable[[int, float], None] | None = None) -> Future: ...

    def stats(self) -> dict: ...
