"""A thread that drives an engine: what a rollout cell's Dask worker holds."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from gyreflow.engine.base import GenerationRequest, LiveRequestState
from gyreflow.faults import FAULTS

log = logging.getLogger(__name__)


class EngineRunner:
    """Loop ``engine.step()`` on a daemon thread while there is work; sleep when there is none.

    Other threads talk to the engine directly (``submit``, ``load_weights``, ``export_request``,
    ``import_request`` are thread-safe) or through the delegates here. The engine must offer
    ``has_work()``, ``wait_for_work(timeout)`` and ``wake()`` besides the Engine protocol.

    Parameters
    ----------
    engine
        The engine to drive, e.g. a :class:`~gyreflow.engine.torch_engine.TorchEngine`.
    idle_timeout
        Longest wait for work before re-checking whether to stop (the wait itself is woken at
        once by new work).
    name
        Thread name.
    """

    def __init__(self, engine, idle_timeout: float = 1.0, name: str | None = None) -> None:
        self.engine = engine
        self.idle_timeout = idle_timeout
        self.name = name or f"engine-runner-{getattr(engine, 'name', 'engine')}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[BaseException] = []
        """Exceptions raised by ``step`` (their live requests' futures already carry them), and
        faults injected at ``engine_step`` (raised before the step runs; no request fails)."""

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> "EngineRunner":
        """Start the loop thread (no-op when it already runs)."""
        if self.running:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        """Ask the loop to end after its current iteration and wait for it.

        Requests still in the engine stay there (waiting or live); a later ``start`` resumes them.
        """
        self._stop.set()
        self.engine.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"{self.name} did not stop within {timeout} s")
            self._thread = None

    def __enter__(self) -> "EngineRunner":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.engine.wait_for_work(self.idle_timeout):
                continue
            if self._stop.is_set():
                break
            try:
                FAULTS.trip_sync("engine_step")
                self.engine.step()
            except Exception as exc:  # the engine failed its live requests; keep serving the rest
                log.exception("engine step failed")
                self.errors.append(exc)

    # Delegates, so a worker can hold just the runner.

    def submit(self, request: GenerationRequest) -> Future:
        return self.engine.submit(request)

    def load_weights(self, weights, version: int) -> None:
        self.engine.load_weights(weights, version)

    def export_request(self, request_id: str) -> LiveRequestState:
        return self.engine.export_request(request_id)

    def import_request(self, state: LiveRequestState, on_token=None) -> Future:
        return self.engine.import_request(state, on_token=on_token)

    def stats(self) -> dict:
        return {**self.engine.stats(), "runner_alive": self.running}
