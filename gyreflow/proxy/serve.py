"""``gyreflow serve``: the proxy on its own over a checkpoint, for evaluation and for pointing a
harness at the policy by hand.

Each session is recorded as one execution of an archive; a session ends when it is closed through
the administration routes or when the server stops, and the server commits everything it recorded
as step 0 when it stops (Ctrl-C included).

Administration (``Authorization: Bearer <admin key>``, printed at start):

    POST   /gyreflow/sessions          open a session -> {"execution_id", "base_url", "api_key"}
    DELETE /gyreflow/sessions/<id>     close it and write it to the archive -> {"execution_id", "calls"}
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import threading
import time
from pathlib import Path

from tornado import web

from gyreflow.proxy.calls import model_card
from gyreflow.proxy.errors import ApiError
from gyreflow.proxy.local import EngineBackend, ProxyThread
from gyreflow.proxy.server import LOOPBACK
from gyreflow.proxy.sessions import Budget, Session
from gyreflow.trajectory.records import ExecutionResult


class _Admin(web.RequestHandler):
    def initialize(self, serve: "Serve") -> None:
        self.serve = serve

    def prepare(self) -> None:
        self.set_header("Content-Type", "application/json")
        auth = self.request.headers.get("Authorization", "")
        if not hmac.compare_digest(auth.encode(), f"Bearer {self.serve.admin_key}".encode()):
            err = ApiError(401, "administration needs the admin key printed by gyreflow serve",
                           type="authentication_error", code="invalid_api_key")
            self.set_status(err.status)
            self.finish(json.dumps(err.body()))

    def post(self) -> None:
        s = self.serve.open_session()
        self.finish({"execution_id": s.execution_id, "base_url": self.serve.proxy.server.base_url(s),
                     "api_key": s.secret})

    async def delete(self, execution_id: str) -> None:
        if execution_id not in self.serve.proxy.registry:
            self.set_status(404)
            self.finish(json.dumps(ApiError(404, f"no open session {execution_id!r}", code="not_found").body()))
            return
        result = await asyncio.get_running_loop().run_in_executor(None, self.serve.finish_session, execution_id)
        self.finish({"execution_id": execution_id, "calls": len(result.calls)})


class Serve:
    """The engine, the proxy and the archive of one ``gyreflow serve``.

    Parameters
    ----------
    checkpoint
        A Hugging Face checkpoint directory written by gyreflow (model and tokenizer).
    out_dir
        Where the archive goes (``out_dir/archive.zarr``); must not hold one already.
    budget
        Each session's budget.
    max_context
        Longest prompt + completion the engine takes; the model's positions by default.
    """

    def __init__(self, checkpoint: str | Path, out_dir: str | Path, *, host: str = LOOPBACK, port: int = 0,
                 model_name: str = "gyreflow-policy", budget: Budget | None = None, max_batch: int = 32,
                 seed: int = 0, max_context: int | None = None) -> None:
        from gyreflow.engine.runner import EngineRunner
        from gyreflow.engine.torch_engine import TorchEngine
        from gyreflow.model import load_tokenizer
        from gyreflow.storage import create_archive

        checkpoint = Path(checkpoint)
        if not (checkpoint / "config.json").is_file():
            raise ValueError(f"{checkpoint} is not a checkpoint directory (no config.json)")
        self.archive = Path(out_dir) / "archive.zarr"
        self.budget = budget or Budget()
        self.seed = seed
        self.admin_key = "gf-admin-" + secrets.token_urlsafe(24)
        self.written: list[str] = []
        self._lock = threading.Lock()
        self._next = 0
        # Bind first: a busy port leaves no archive and no engine behind.
        self.proxy = ProxyThread(model_card(load_tokenizer(checkpoint), model_name), host=host, port=port,
                                 extra_handlers=[(r"/gyreflow/sessions", _Admin, {"serve": self}),
                                                 (r"/gyreflow/sessions/([^/]+)", _Admin, {"serve": self})])
        try:
            try:
                engine = TorchEngine.from_checkpoint(checkpoint, max_batch=max_batch, max_seq_len=max_context)
            except ValueError as err:
                raise ValueError(f"--max-context {max_context}: {err}") from None
            self.max_context = engine.max_seq_len
            self.runner = EngineRunner(engine).start()
            self.backend = EngineBackend(self.runner)
            create_archive(self.archive, run_meta={"pipeline": "serve", "checkpoint": str(checkpoint.resolve()),
                                                   "model_name": model_name})
        except BaseException:
            self.proxy.stop()
            if getattr(self, "runner", None) is not None:
                self.runner.stop()
            raise

    def open_session(self) -> Session:
        """A new session (on the proxy's loop or any thread)."""
        with self._lock:
            eid = f"serve-{self._next:04d}"
            self._next += 1
        if self.proxy.thread.on_loop():
            return self.proxy.registry.open(eid, self.backend, budget=self.budget, seed=self.seed)
        return self.proxy.open(eid, self.backend, budget=self.budget, seed=self.seed)

    def finish_session(self, execution_id: str, reason: str = "closed") -> ExecutionResult:
        """Close a session and write its calls to the archive as one execution."""
        from gyreflow.storage import write_execution

        session = self.proxy.close(execution_id)
        index = int(execution_id.rsplit("-", 1)[1])
        result = ExecutionResult(execution_id=execution_id, task_id="serve", step=0, sample=index, split="serve",
                                 calls=list(session.records), reward=0.0, passed=False, end_reason="done",
                                 metrics={"closed": reason, "tokens_generated": session.tokens_generated,
                                          "calls_refused": dict(session.refused)})
        write_execution(self.archive, result)
        with self._lock:
            self.written.append(execution_id)
        return result

    def stop(self) -> dict:
        """Close every open session, commit the archive, stop the proxy and the engine."""
        from gyreflow.storage import commit_step

        for s in self.proxy.registry.sessions():
            self.finish_session(s.execution_id, reason="server_stopped")
        self.proxy.stop()
        self.runner.stop()
        summary = {"executions": len(self.written), "stopped": time.time()}
        commit_step(self.archive, 0, summary, expected=self.written)
        return summary
