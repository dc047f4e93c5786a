"""The engine interface: requests, results, live-request state and the Engine protocol."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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


@dataclass
class GenerationRequest:
    request_id: str
    prompt_ids: np.ndarray  # (P,) int32
    params: SamplingParams = field(default_factory=SamplingParams)
    session: str | None = None
    """Requests of one session may reuse the KV cache of that session's previous request."""


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


@runtime_checkable
class Engine(Protocol):
    """A model replica that serves generation requests with continuous batching."""

    version: int

    def submit(self, request: GenerationRequest) -> Future: ...

    def step(self) -> int: ...

    def load_weights(self, weights: dict[str, np.ndarray], version: int) -> None: ...

    def export_request(self, request_id: str): ...

    def import_request(self, state) -> Future: ...

    def stats(self) -> dict: ...
