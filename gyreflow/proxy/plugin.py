"""The proxy on a Dask worker that runs executions: one HTTP server per worker, on the worker's
event loop, one session per external execution; calls go through the router to the engines."""

from __future__ import annotations

import logging

from distributed import WorkerPlugin
from distributed.utils import sync

from gyreflow.proxy.calls import model_card
from gyreflow.proxy.server import LOOPBACK, ProxyServer
from gyreflow.proxy.sessions import Budget, Generate, SamplingPin, Session, SessionRegistry

log = logging.getLogger(__name__)

PLUGIN_NAME = "gyreflow-proxy"


class ProxyPlugin(WorkerPlugin):
    """Serve the OpenAI API for the executions of this worker.

    Parameters
    ----------
    tokenizer
        Directory of the served model's tokenizer (``save_pretrained`` format); ``None`` builds
        gyreflow's byte-level tokenizer.
    model_name
        The model name agents must ask for.
    parser
        Tool-call parser matching the tokenizer's chat template (a key of ``TOOL_PARSERS``).
    host
        Interface to bind; loopback unless set otherwise.
    max_body_bytes
        Largest request body accepted.
    """

    name = PLUGIN_NAME

    def __init__(self, tokenizer: str | None = None, model_name: str = "gyreflow-policy", parser: str = "hermes",
                 host: str = LOOPBACK, max_body_bytes: int = 16 << 20) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.parser = parser
        self.host = host
        self.max_body_bytes = max_body_bytes
        self.server: ProxyServer | None = None
        self.worker = None

    async def setup(self, worker) -> None:
        self.worker = worker

    def _start(self) -> ProxyServer:
        # Started at the first session: only workers that run external executions listen.
        if self.server is None:
            from gyreflow.model import build_tokenizer, load_tokenizer

            tok = load_tokenizer(self.tokenizer) if self.tokenizer else build_tokenizer()
            self.server = ProxyServer(SessionRegistry(), model_card(tok, self.model_name, self.parser),
                                      host=self.host, max_body_bytes=self.max_body_bytes).start()
            log.info("gyreflow proxy for %s at %s", self.worker.address, self.server.url)
        return self.server

    async def teardown(self, worker) -> None:
        if self.server is not None:
            await self.server.stop()

    # Called from execution tasks (worker threads): the registry lives on the worker's loop.

    def open(self, execution_id: str, generate: Generate, *, budget: Budget | None = None, seed: int = 0,
             role: str = "", pin: SamplingPin | None = None) -> Session:
        async def run() -> Session:
            return self._start().registry.open(execution_id, generate, budget=budget, seed=seed, role=role, pin=pin)

        return sync(self.worker.loop, run)

    def close(self, execution_id: str) -> Session:
        async def run() -> Session:
            return self.server.registry.close(execution_id)

        return sync(self.worker.loop, run)

    def environment(self, session: Session) -> dict[str, str]:
        return self.server.environment(session)
