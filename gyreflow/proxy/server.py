"""The proxy's HTTP server: the OpenAI endpoints over tornado, on loopback unless told otherwise.

Routes (each also under ``/s/<execution>/``, a base URL that names the session):

    GET  /v1/models, /v1/models/<name>
    POST /v1/chat/completions, /v1/completions, /v1/responses
    GET  /health                                   (no key needed)
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
import socket

from tornado import httpserver, netutil, web
from tornado.iostream import StreamClosedError

from gyreflow.proxy.calls import ModelCard, call_role, prepare_call, serve_call
from gyreflow.proxy.errors import ApiError, bad_request
from gyreflow.proxy.requests import PARSERS
from gyreflow.proxy.responses import BUILDERS, LIVE_ENDPOINTS, sse, text_delta
from gyreflow.proxy.sessions import Reply, Session, SessionRegistry
from gyreflow.proxy.streaming import TokenStream

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
SESSION = r"(?:/s/(?P<sid>[A-Za-z0-9_.:@=+-]{1,200}))?"


class _Handler(web.RequestHandler):
    def initialize(self, proxy: "ProxyServer") -> None:
        self.proxy = proxy

    def set_default_headers(self) -> None:
        self.set_header("Content-Type", "application/json")

    def fail(self, err: ApiError) -> None:
        self.set_status(err.status)
        if err.retry is not None:
            self.set_header("x-should-retry", "true" if err.retry else "false")
        self.finish(json.dumps(err.body()))

    def write_error(self, status_code: int, **kwargs) -> None:
        reason = self._reason or "error"
        kind = "server_error" if status_code >= 500 else "invalid_request_error"
        self.finish(json.dumps({"error": {"message": reason, "type": kind, "param": None, "code": None}}))

    def session(self, sid: str | None) -> Session:
        return self.proxy.registry.authenticate(sid, self.request.headers.get("Authorization"),
                                                self.request.headers.get("api-key"))


class NotFound(_Handler):
    def prepare(self) -> None:
        self.fail(ApiError(404, f"no route {self.request.method} {self.request.path}", code="not_found"))


class Health(_Handler):
    def get(self) -> None:
        self.finish({"status": "ok", "sessions": len(self.proxy.registry)})


class Models(_Handler):
    def _card(self) -> dict:
        return {"id": self.proxy.card.name, "object": "model", "created": 0, "owned_by": "gyreflow"}

    def get(self, sid: str | None = None, name: str | None = None) -> None:
        try:
            self.session(sid)
            if name is None:
                self.finish({"object": "list", "data": [self._card()]})
                return
            self.proxy.card.check_model(name)
            self.finish(self._card())
        except ApiError as err:
            self.fail(err)


@web.stream_request_body
class Generate(_Handler):
    """One of the three generation endpoints; the body is read in chunks so an oversized one is
    refused with a proper error after it is drained."""

    def initialize(self, proxy: "ProxyServer", endpoint: str) -> None:
        super().initialize(proxy)
        self.endpoint = endpoint
        self.chunks: list[bytes] = []
        self.size = 0
        self.closed = False

    def prepare(self) -> None:
        # Any size is drained (what passes the limit is counted, not kept) so that every
        # oversized body gets its 413 instead of a connection cut while the client still writes.
        self.request.connection.set_max_body_size(1 << 62)

    def data_received(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size <= self.proxy.max_body_bytes:
            self.chunks.append(chunk)

    def on_connection_close(self) -> None:
        self.closed = True

    def _client_gone(self) -> bool:
        """Whether the client hung up. HTTP clients send nothing while they wait for a reply, so
        a readable socket with no data means the peer closed it."""
        stream = self.request.connection.stream
        if self.closed or stream.closed():
            return True
        try:
            return stream.socket.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    async def post(self, sid: str | None = None) -> None:
        try:
            await self._post(sid)
        except ApiError as err:
            if not self._headers_written:
                self.fail(err)
        except StreamClosedError:
            pass  # the client went away mid-stream: nothing to answer, nothing recorded
        except Exception:
            log.exception("gyreflow proxy: %s failed", self.request.path)
            if not self._headers_written:
                self.fail(ApiError(500, "internal error in the gyreflow proxy", type="server_error"))

    async def _post(self, sid: str | None) -> None:
        if self.size > self.proxy.max_body_bytes:
            raise ApiError(413, f"request body of {self.size} bytes exceeds the limit of {self.proxy.max_body_bytes}",
                           code="request_too_large")
        session = self.session(sid)
        raw = b"".join(self.chunks)
        try:
            body = json.loads(raw)
        except ValueError as err:
            raise bad_request(f"could not parse the JSON body: {err}") from None
        if not isinstance(body, dict):
            raise bad_request(f"the JSON body must be an object, got {type(body).__name__}")
        spec = PARSERS[self.endpoint](body)
        self.proxy.card.check_model(spec.model)
        role = call_role(self.request.headers.get("X-Gyreflow-Role"), session)
        key = hashlib.sha256(self.endpoint.encode() + b"\0" + raw).hexdigest()
        retry = self.request.headers.get("x-stainless-retry-count", "0") not in ("", "0")
        whole, events = BUILDERS[self.endpoint]
        if not spec.stream:
            reply = await serve_call(session, spec, key, self.proxy.card, retry=retry, role=role)
            payload = json.dumps(whole(reply, spec, self.proxy.card), ensure_ascii=False)
            # Recorded before the last bytes leave, so a client never sees its reply unrecorded; a
            # client already gone is not (its retry gets the same reply, recorded then).
            if not self._client_gone():
                session.delivered(reply)
            self.finish(payload)
            return
        prepared = None
        if session.existing(key, retry) is None:
            # Refusals (budget, bad prompt) are HTTP errors, before the stream begins.
            prepared = await prepare_call(session, spec, self.proxy.card)
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        await self.flush()
        live = self.endpoint in LIVE_ENDPOINTS and not (spec.tools and spec.tool_choice != "none")
        stream = TokenStream(asyncio.get_running_loop(), self.proxy.card.renderer.decode,
                             hold=max((len(s) for s in spec.stop), default=0)) if live else None
        started: list[Reply] = []
        call = asyncio.ensure_future(serve_call(session, spec, key, self.proxy.card, retry=retry, role=role,
                                                prepared=prepared, started=started.append,
                                                on_token=stream.push if stream else None))
        call.add_done_callback(lambda f: f.cancelled() or f.exception())  # the client may be gone by then
        opened = False  # whether the chat stream's first (role) chunk went out
        while stream is not None:
            token = asyncio.ensure_future(stream.queue.get())
            await asyncio.wait({token, call}, return_when=asyncio.FIRST_COMPLETED)
            if not token.done():
                token.cancel()
                break
            text = stream.delta(token.result())
            if text and started:
                if self.endpoint == "chat" and not opened:
                    self.write(sse(next(events(started[0], spec, self.proxy.card))))  # the role chunk
                    opened = True
                self.write(sse(text_delta(self.endpoint, started[0], self.proxy.card, text)))
                await self.flush()
        try:
            reply = await call
        except Exception as err:
            if not isinstance(err, ApiError):
                log.exception("gyreflow proxy: %s failed", self.request.path)
            out = err if isinstance(err, ApiError) else ApiError(500, "internal error in the gyreflow proxy",
                                                                  type="server_error")
            self.write(sse(out.body(), "error" if self.endpoint == "responses" else None))
            self.finish()
            return
        if stream is not None and stream.sent:
            # The rest of the stream, from the reply less the text already sent.
            reply_view = copy.copy(reply)
            try:
                reply_view.content = stream.rest(reply.content)
            except RuntimeError as err:  # a call run again elsewhere sampled other tokens
                self.write(sse(ApiError(502, f"the call's stream cannot be completed: {err}", type="server_error")
                               .body(), "error" if self.endpoint == "responses" else None))
                self.finish()
                return
            payloads = list(events(reply_view, spec, self.proxy.card))[1 if opened else 0:]
        else:
            payloads = list(events(reply, spec, self.proxy.card))
        named = self.endpoint == "responses"
        for payload in payloads[:-1]:
            self.write(sse(payload, payload["type"] if named else None))
        await self.flush()
        if self._client_gone():
            return
        session.delivered(reply)
        self.write(sse(payloads[-1], payloads[-1]["type"] if named else None))
        if not named:
            self.write(b"data: [DONE]\n\n")
        self.finish()


class ProxyServer:
    """The proxy: sessions, the model card, and an HTTP server on the current event loop.

    Parameters
    ----------
    registry
        The sessions it serves.
    card
        The model it serves (name, renderer, tool-call parser).
    host
        Interface to bind; loopback unless set otherwise.
    port
        0 picks a free port.
    max_body_bytes
        Largest request body accepted (413 above it).
    extra_handlers
        More tornado routes (``gyreflow serve`` adds its session administration).
    """

    def __init__(self, registry: SessionRegistry, card: ModelCard, *, host: str = LOOPBACK, port: int = 0,
                 max_body_bytes: int = 16 << 20, extra_handlers: list | None = None) -> None:
        self.registry = registry
        self.extra_handlers = list(extra_handlers or [])
        self.card = card
        self.host = host
        self.port = port
        self.max_body_bytes = int(max_body_bytes)
        self._server: httpserver.HTTPServer | None = None
        self.sockets: list = []
        """The listening sockets, once started."""

    def app(self) -> web.Application:
        p = {"proxy": self}
        return web.Application([
            (r"/health", Health, p),
            (SESSION + r"/v1/models", Models, p),
            (SESSION + r"/v1/models/(?P<name>[^/]+)", Models, p),
            (SESSION + r"/v1/chat/completions", Generate, p | {"endpoint": "chat"}),
            (SESSION + r"/v1/completions", Generate, p | {"endpoint": "completions"}),
            (SESSION + r"/v1/responses", Generate, p | {"endpoint": "responses"}),
            *self.extra_handlers,
        ], default_handler_class=NotFound, default_handler_args=p)

    def start(self) -> "ProxyServer":
        """Bind and serve on the running event loop."""
        self.sockets = sockets = netutil.bind_sockets(self.port, self.host)
        self.port = sockets[0].getsockname()[1]
        # Generation bodies are streamed and drained whatever their size (see Generate.prepare);
        # this cap guards the other endpoints.
        self._server = httpserver.HTTPServer(self.app(), max_body_size=4 * self.max_body_bytes,
                                             idle_connection_timeout=300)
        self._server.add_sockets(sockets)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            await self._server.close_all_connections()
            self._server = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, session: Session) -> str:
        return f"{self.url}/s/{session.execution_id}/v1"

    def environment(self, session: Session) -> dict[str, str]:
        """What an unmodified agent program needs to reach its session (the variable names the
        official SDK, litellm and common harnesses read)."""
        base = self.base_url(session)
        return {"OPENAI_BASE_URL": base, "OPENAI_API_BASE": base, "OPENAI_API_KEY": session.secret,
                "OPENAI_MODEL": self.card.name, "GYREFLOW_EXECUTION_ID": session.execution_id}
