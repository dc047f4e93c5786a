"""The proxy on an event loop of its own, for programs that are not already async: ``gyreflow
serve``, the tests and the benchmark. On a Dask worker the proxy runs on the worker's loop instead
(:mod:`gyreflow.proxy.plugin`)."""

from __future__ import annotations

import asyncio
import threading

from gyreflow.engine.base import GenerationRequest, GenerationResult
from gyreflow.proxy.calls import ModelCard
from gyreflow.proxy.server import LOOPBACK, ProxyServer
from gyreflow.proxy.sessions import Budget, Generate, SamplingPin, Session, SessionRegistry


class EngineBackend:
    """``generate`` for sessions served by an engine in this process (anything with a thread-safe
    ``submit(request) -> concurrent.futures.Future``, e.g. an :class:`~gyreflow.engine.runner.EngineRunner`)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    async def __call__(self, request: GenerationRequest) -> GenerationResult:
        return await asyncio.wrap_future(self.engine.submit(request))


class LoopThread:
    """An asyncio event loop on a daemon thread, for servers that serve synchronous callers."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, fn, *args, **kwargs):
        """Run ``fn`` (a function or a coroutine function) on the loop; its result, from any other
        thread."""
        async def run():
            out = fn(*args, **kwargs)
            return await out if asyncio.iscoroutine(out) else out

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    def on_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()


class ProxyThread:
    """A :class:`ProxyServer` on a daemon thread's event loop; its methods are thread-safe."""

    def __init__(self, card: ModelCard, *, host: str = LOOPBACK, port: int = 0, max_body_bytes: int = 16 << 20,
                 extra_handlers: list | None = None) -> None:
        self.registry = SessionRegistry()
        self.thread = LoopThread("gyreflow-proxy")
        self.server = ProxyServer(self.registry, card, host=host, port=port, max_body_bytes=max_body_bytes,
                                  extra_handlers=extra_handlers)
        try:
            self.thread.call(self.server.start)
        except BaseException:  # e.g. the port is taken: leave no thread behind
            self.thread.close()
            raise

    @property
    def url(self) -> str:
        return self.server.url

    def open(self, execution_id: str, generate: Generate, *, budget: Budget | None = None, seed: int = 0,
             role: str = "", pin: SamplingPin | None = None) -> Session:
        return self.thread.call(self.registry.open, execution_id, generate, budget=budget, seed=seed, role=role,
                                pin=pin)

    def close(self, execution_id: str) -> Session:
        return self.thread.call(self.registry.close, execution_id)

    def environment(self, session: Session) -> dict[str, str]:
        return self.server.environment(session)

    def stop(self) -> None:
        if not self.thread.loop.is_closed():
            self.thread.call(self.server.stop)
            self.thread.close()

    def __enter__(self) -> "ProxyThread":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


