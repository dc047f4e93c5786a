"""Tokens of a generation sent as they are sampled, from the engine's worker to the worker whose
call asked for them (the proxy streams them to its client).

The caller opens a :func:`token_sink` for the request and names its worker as ``stream_to`` in the
request message; the engine's service gives the request a :class:`TokenSender` that forwards the
tokens in batches over Dask comms (``gyreflow_tokens`` on the caller's worker), in order, one batch
in flight at a time. Every batch carries the index of its first token, so a request that migrates
(the new engine sends from the tokens it brought along, perhaps before the old engine's last
batch arrives) or runs again after its engine was lost is delivered in order, nothing repeated.
Streaming is best effort: a sender whose caller cannot be reached stops, and the caller takes
whatever it lacks from the final result, which is authoritative.
"""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

HANDLER = "gyreflow_tokens"

OnToken = Callable[[int, float], None]


@dataclass
class _Sink:
    on_token: OnToken
    count: int = 0
    """Tokens delivered so far."""
    early: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """offset -> (tokens, log-probs) of batches that arrived before the tokens ahead of them."""

    def take(self, offset: int, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        self.early[offset] = (tokens, logprobs)
        while True:
            ready = [o for o in self.early if o <= self.count]
            if not ready:
                return
            for o in ready:
                toks, lps = self.early.pop(o)
                skip = self.count - o
                for tok, lp in zip(toks[skip:].tolist(), lps[skip:].tolist()):
                    self.on_token(tok, lp)
                    self.count += 1


_SINKS: dict[str, _Sink] = {}
"""request id -> its sink, for every caller on this process (request ids are unique in a run)."""


def deliver(request_id: str, offset: int, tokens: bytes, logprobs: bytes) -> dict:
    """The ``gyreflow_tokens`` handler: pass a batch's new tokens to the request's ``on_token``, in
    order (a batch ahead of a missing one waits for it; tokens already delivered are skipped).

    Returns ``{"ok": False}`` when nobody waits for the request any more: the sender then stops.
    """
    sink = _SINKS.get(request_id)
    if sink is None:
        return {"ok": False}
    sink.take(int(offset), np.frombuffer(tokens, np.int32), np.frombuffer(logprobs, np.float32))
    return {"ok": True}


@contextmanager
def token_sink(worker, request_id: str, on_token: OnToken) -> Iterator[str]:
    """Receive ``request_id``'s tokens on ``worker`` (its event loop calls ``on_token``) while open;
    yields the address engines send them to."""
    worker.handlers.setdefault(HANDLER, deliver)
    _SINKS[request_id] = _Sink(on_token)
    try:
        yield worker.address
    finally:
        _SINKS.pop(request_id, None)


class TokenSender:
    """Forwards one request's tokens to the worker at ``dest``.

    Parameters
    ----------
    worker
        The engine's worker (its ``rpc`` pool sends the batches).
    dest
        Address of the worker with the request's :func:`token_sink`.
    request_id
        The request.
    offset
        Index of the first token this sender sees in the whole completion (tokens sampled
        before a migration are not sent again).
    """

    def __init__(self, worker, dest: str, request_id: str, offset: int = 0) -> None:
        self.worker = worker
        self.dest = dest
        self.request_id = request_id
        self.sent = int(offset)
        self.loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._tokens: list[int] = []
        self._logprobs: list[float] = []
        self._sending = False
        self.stopped = False
        """The caller stopped listening (or could not be reached): nothing more is sent."""

    def push(self, token: int, logprob: float) -> None:
        """The engine's ``on_token`` (engine thread)."""
        with self._lock:
            if self.stopped:
                return
            self._tokens.append(int(token))
            self._logprobs.append(float(logprob))
            if self._sending:
                return  # the running send takes it with the next batch
            self._sending = True
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._send()))

    async def _send(self) -> None:
        while True:
            with self._lock:
                tokens, logprobs = self._tokens, self._logprobs
                self._tokens, self._logprobs = [], []
                if not tokens or self.stopped:
                    self._sending = False
                    return
            offset = self.sent
            self.sent += len(tokens)
            try:
                out = await getattr(self.worker.rpc(self.dest), HANDLER)(
                    request_id=self.request_id, offset=offset, tokens=np.asarray(tokens, np.int32).tobytes(),
                    logprobs=np.asarray(logprobs, np.float32).tobytes())
            except Exception:  # the caller's worker is gone: the final result still reaches whoever asks
                out = {"ok": False}
            if not out.get("ok"):
                with self._lock:
                    self.stopped = True
