"""`benchmarks/proxy_overhead.py`: the latency the OpenAI-compatible proxy adds to one model call.

The engine behind the proxy is a :class:`ZeroCostEngine` (it answers at once, with a fixed
completion), so everything measured is the proxy's own cost. Three paths are timed in the same
run, call by call, on the same request:

direct
    The engine call the proxy makes, in-process: ``await EngineBackend(engine)(request)`` on an
    asyncio loop, with the prompt ids and sampling parameters the proxy gives the engine for the
    first request (rendered once, beforehand: the engine call alone is timed).
proxied
    A chat completion (``POST /s/<execution>/v1/chat/completions``) through a
    :class:`~gyreflow.proxy.local.ProxyThread` over one keep-alive HTTP connection: a realistic agent
    request (system, user, assistant turns with tool calls, tool results; three tools). Each call
    brings a new last message and seed, as an agent's calls do, so the proxy's retry
    de-duplication never answers one without the engine, and no cache can serve it whole; each is
    checked to have reached the engine exactly once, and to be recorded.
HTTP floor
    The same request to a trivial tornado handler that answers with the proxy's reply, fixed: what
    HTTP, tornado and the client cost on their own, to tell them apart from the proxy's logic.

The paths take turns call by call, so that the machine's drifts weigh on all of them alike.

The client is either ``http`` (``http.client``: a lean client, to measure the proxy) or
``openai`` (the official SDK: what an agent using it sees). The proxy serves on its own thread,
the client runs in the calling thread: they share the machine's cores, as a proxy serving a local
agent does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import os
import threading
import time
from concurrent.futures import Future
from urllib.parse import urlsplit

import numpy as np
from tornado import httpserver, netutil, web

from gyreflow.engine.base import GenerationRequest, GenerationResult, SamplingParams
from gyreflow.model.chat import END_ID

TARGET_ADDED_P50_MS = 2.0
"""The issue's target: the proxy adds at most this much to a call's median latency."""
CLIENTS = ("http", "openai")
COMPLETION = (*b"ok", END_ID)
"""What the zero-cost engine samples: ``ok`` and the end of the turn."""


class ZeroCostEngine:
    """An engine that costs nothing: ``submit`` returns a future already resolved with a fixed
    completion. No sleeping, no work; it only counts the calls and keeps the last request, so a
    benchmark can check that every call it timed really reached the engine.

    Parameters
    ----------
    completion
        The ids every call samples (``ok<|end|>`` by default, a stop on the end id).
    name
        The engine name its results carry.
    """

    def __init__(self, completion=COMPLETION, name: str = "zero-cost") -> None:
        # Shared by every result, so read-only: a record must never see another call's edit.
        self.completion = _frozen(np.asarray(completion, dtype=np.int32))
        self.logprobs = _frozen(np.zeros(len(self.completion), dtype=np.float32))
        self.versions = _frozen(np.zeros(len(self.completion), dtype=np.int32))
        self.name = name
        self.version = 0
        self.calls = 0
        self.last: GenerationRequest | None = None
        self.last_of: dict[str | None, GenerationRequest] = {}
        """The last request of each session."""
        self._lock = threading.Lock()  # submit may come from several threads' loops

    def submit(self, request: GenerationRequest) -> Future:
        with self._lock:
            self.calls += 1
            self.last = self.last_of[request.session] = request
        future: Future = Future()
        future.set_result(GenerationResult(request.request_id, request.prompt_ids, self.completion, self.logprobs,
                                           self.versions, "stop", engine=self.name))
        return future


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


# -- the request -------------------------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root."},
            "start": {"type": "integer", "description": "First line (1-based)."},
            "end": {"type": "integer", "description": "Last line, inclusive."}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_command", "description": "Run a shell command in the sandbox and return its output.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "timeout_s": {"type": "number"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "edit_file", "description": "Replace an exact string in a file.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"]}}},
]

_ACTIONS = [
    ("read_file", {"path": "src/parser.py", "start": 1, "end": 60},
     "1: import re\n2: \n3: TOKEN = re.compile(r\"\\s*(\\d+|\\S)\")\n4: \n5: def parse(text):\n"
     "6:     tokens = TOKEN.findall(text)\n7:     return _expr(tokens, 0)[0]\n"),
    ("run_command", {"command": "python -m pytest tests/test_parser.py -x -q", "timeout_s": 60},
     "F\n=== FAILURES ===\ntest_precedence: assert parse('1+2*3') == 7, got 9\n1 failed in 0.12s\n"),
    ("edit_file", {"path": "src/parser.py", "old": "return _expr(tokens, 0)[0]", "new": "return _sum(tokens, 0)[0]"},
     "edited src/parser.py (1 replacement)\n"),
]


def agent_messages(n: int) -> list[dict]:
    """A coding agent's conversation of ``n`` messages (at least 2): the system prompt, the task,
    then assistant turns that call a tool, each followed by the tool's output (and a user nudge
    when ``n`` leaves room for one message only)."""
    if n < 2:
        raise ValueError(f"prompt_messages must be at least 2 (system and user), got {n}")
    messages = [
        {"role": "system", "content": "You are a careful software engineer. Use the tools to inspect and change "
                                      "the repository; answer briefly once the tests pass."},
        {"role": "user", "content": "The parser gets operator precedence wrong: 1+2*3 gives 9. Fix it and "
                                    "make tests/test_parser.py pass."},
    ]
    turn = 0
    while len(messages) + 2 <= n:
        name, args, output = _ACTIONS[turn % len(_ACTIONS)]
        cid = f"call_{turn:04d}bench"
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        messages.append({"role": "tool", "tool_call_id": cid, "content": output})
        turn += 1
    if len(messages) < n:
        messages.append({"role": "user", "content": "Go on."})
    return messages


def call_messages(messages: list[dict], i: int) -> list[dict]:
    """The conversation of call ``i``: ``messages`` with ``[call i]`` added to the newest one, as
    each of an agent's calls brings new output after the same history (and so no two calls of a
    run send the same request)."""
    last = messages[-1]
    return messages[:-1] + [last | {"content": f"{last['content']}\n[call {i}]"}]


def chat_body(model: str, messages: list[dict], i: int) -> dict:
    """The request body of call ``i`` (its seed is ``i``)."""
    return {"model": model, "messages": call_messages(messages, i), "tools": TOOLS, "tool_choice": "auto",
            "temperature": 1.0, "seed": i}


def engine_call(card, body: dict, max_tokens_per_call: int, execution_id: str, index: int
                ) -> tuple[np.ndarray, SamplingParams]:
    """The prompt ids and sampling parameters the proxy gives the engine for ``body`` as call
    ``index`` of session ``execution_id`` (seed 0), computed as
    :func:`gyreflow.proxy.calls.serve_call` computes them (no restored turns: the bench's tool-call
    ids are not the session's)."""
    from gyreflow.proxy.calls import sampling_params
    from gyreflow.proxy.requests import parse_chat

    spec = parse_chat(body)
    forced = card.parser.forced_prefix(spec.tool_choice) if spec.tools else ""
    prompt = card.renderer.render(spec.messages, spec.tools, {}, forced)
    max_tokens = min(spec.max_tokens or max_tokens_per_call, max_tokens_per_call)
    return prompt, sampling_params(spec, max_tokens, card.renderer.eos_id, 0, execution_id, index)


# -- figures -----------------------------------------------------------------------------------

def summarise(seconds: list[float], wall_s: float | None = None) -> dict:
    """Per-call latency figures in milliseconds; calls/s over ``wall_s`` (the sum of the calls'
    times when not given: calls made one after another)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    wall = float(np.sum(seconds)) if wall_s is None else wall_s
    return {"calls": len(ms), "p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "min_ms": float(ms.min()), "max_ms": float(ms.max()),
            "calls_per_s": len(ms) / wall if wall > 0 else float("inf")}


# -- the three paths ---------------------------------------------------------------------------

async def direct_call(generate, engine: ZeroCostEngine, prompt: np.ndarray, params: SamplingParams, i: int,
                      execution_id: str = "bench-direct") -> float:
    """Seconds of one engine call as the proxy makes it (``generate`` is an
    :class:`~gyreflow.proxy.local.EngineBackend`); it must reach ``engine`` exactly once."""
    before = engine.calls
    t0 = time.perf_counter()
    # Built inside the timed span, as serve_call builds it for every call.
    request = GenerationRequest(f"{execution_id}/{i}", prompt, dataclasses.replace(params, seed=i),
                                session=execution_id)
    result = await generate(request)
    t1 = time.perf_counter()
    if engine.calls != before + 1 or result.request_id != request.request_id:
        raise AssertionError(f"direct call {i} was not served by the engine exactly once")
    return t1 - t0


class HttpClient:
    """``http.client`` over one keep-alive connection: the least a client can add."""

    def __init__(self, base_url: str, key: str) -> None:
        u = urlsplit(base_url)
        self.path = u.path.rstrip("/") + "/chat/completions"
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        self.headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}",
                        "Connection": "keep-alive"}

    def call(self, body: dict) -> bytes:
        """One call; the reply's body. The request is encoded inside the timed span: a client pays it."""
        self.conn.request("POST", self.path, json.dumps(body).encode(), self.headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise AssertionError(f"HTTP {resp.status}: {data[:300]!r}")
        return data

    @staticmethod
    def content(reply: bytes) -> tuple[str | None, str]:
        choice = json.loads(reply)["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]

    def close(self) -> None:
        self.conn.close()


class OpenAIClient:
    """The official ``openai`` SDK (no retries: a failure must show)."""

    def __init__(self, base_url: str, key: str) -> None:
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=60)

    def call(self, body: dict):
        return self.client.chat.completions.create(**body)

    @staticmethod
    def content(reply) -> tuple[str | None, str]:
        return reply.choices[0].message.content, reply.choices[0].finish_reason

    def close(self) -> None:
        self.client.close()


def make_client(kind: str, base_url: str, key: str) -> HttpClient | OpenAIClient:
    if kind not in CLIENTS:
        raise ValueError(f"client must be one of {CLIENTS}, got {kind!r}")
    return HttpClient(base_url, key) if kind == "http" else OpenAIClient(base_url, key)


def http_call(client: HttpClient | OpenAIClient, body: dict, engine: ZeroCostEngine | None = None) -> float:
    """Seconds of one chat completion; with ``engine``, the call must reach it exactly once."""
    before = engine.calls if engine is not None else 0
    t0 = time.perf_counter()
    reply = client.call(body)
    t1 = time.perf_counter()
    if engine is not None and engine.calls != before + 1:
        raise AssertionError(f"call {body['seed']}: the engine served {engine.calls - before} calls, not 1")
    content, finish = client.content(reply)
    if (content, finish) != ("ok", "stop"):
        raise AssertionError(f"call {body['seed']}: unexpected reply {content!r}, {finish!r}")
    return t1 - t0


def time_concurrent(kind: str, base_url: str, key: str, model: str, messages: list[dict], calls: range,
                    concurrency: int) -> tuple[list[float], float]:
    """``calls`` split over ``concurrency`` threads, each with its own client (its own
    connection); per-call seconds and the wall seconds of them all."""
    shares = [calls[t::concurrency] for t in range(concurrency)]
    clients = [make_client(kind, base_url, key) for _ in range(concurrency)]
    bodies = [[chat_body(model, messages, i) for i in share] for share in shares]
    results: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[BaseException] = []
    start = threading.Barrier(concurrency + 1)

    def work(t: int) -> None:
        try:
            start.wait()
            results[t] = [http_call(clients[t], body) for body in bodies[t]]
        except BaseException as err:  # re-raised by the calling thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(t,), name=f"bench-client-{t}") for t in range(concurrency)]
    for th in threads:
        th.start()
    start.wait()
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    for c in clients:
        c.close()
    if errors:
        raise errors[0]
    return [x for r in results for x in r], wall


class FloorServer:
    """A trivial tornado server on a thread's event loop, like the proxy's: every POST (the body
    read in chunks, as the proxy reads it) gets ``reply``, a fixed JSON."""

    def __init__(self, reply: bytes) -> None:
        from gyreflow.proxy.local import LoopThread

        self.reply = reply
        self.thread = LoopThread("gyreflow-bench-floor")
        self.port = self.thread.call(self._start)

    def _start(self) -> int:
        from gyreflow.proxy.server import LOOPBACK

        sockets = netutil.bind_sockets(0, LOOPBACK)
        self._server = httpserver.HTTPServer(web.Application([(r"/.*", _Fixed, {"reply": self.reply})]),
                                             idle_connection_timeout=300)
        self._server.add_sockets(sockets)
        return sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/s/floor/v1"

    def stop(self) -> None:
        async def stop() -> None:
            self._server.stop()
            await self._server.close_all_connections()

        self.thread.call(stop)
        self.thread.close()

    def __enter__(self) -> "FloorServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@web.stream_request_body
class _Fixed(web.RequestHandler):
    def initialize(self, reply: bytes) -> None:
        self.reply = reply
        self.chunks: list[bytes] = []

    def data_received(self, chunk: bytes) -> None:
        self.chunks.append(chunk)

    def post(self) -> None:
        self.set_header("Content-Type", "application/json")
        self.finish(self.reply)


# -- the benchmark -----------------------------------------------------------------------------

def run_bench(calls: int = 2000, warmup: int = 200, prompt_messages: int = 8, concurrency: int = 1,
              client: str = "http", floor: bool = True) -> dict:
    """Time direct, proxied and HTTP-floor calls in this one run.

    The paths take turns call by call (in a rotating order), so a drift of the machine's state
    (frequency, which cores the threads run on) weighs on all of them alike.

    Parameters
    ----------
    calls
        Timed calls of each path (after ``warmup`` untimed ones).
    warmup
        Untimed calls of each path first: imports, first-call paths, the connections.
    prompt_messages
        Messages of the request (at least 2).
    concurrency
        Above 1, another ``calls`` proxied calls from this many threads at once, each with its own
        connection, for calls/s under load.
    client
        ``http`` (``http.client``, one keep-alive connection) or ``openai`` (the official SDK).
    floor
        Also time the trivial tornado server (the HTTP floor).

    Returns
    -------
    dict
        ``direct``, ``proxied``, ``floor`` (or ``None``), ``concurrent`` (or ``None``): latency
        figures of :func:`summarise`; ``added_p50_ms``/``added_p99_ms`` (proxied less direct),
        ``ratio_p50``/``ratio_mean`` (proxied / direct), ``proxy_logic_p50_ms`` (proxied less the
        floor), ``target_added_p50_ms``, ``target_met``; the checks ``engine_calls`` (equal to
        ``expected_engine_calls``, direct calls included) and ``records`` (equal to
        ``expected_records``, the proxied calls); the request's size and the setting.
    """
    from gyreflow.model import build_tokenizer
    from gyreflow.proxy.calls import model_card
    from gyreflow.proxy.local import EngineBackend, ProxyThread
    from gyreflow.proxy.sessions import Budget

    if calls < 1 or warmup < 0 or concurrency < 1:
        raise ValueError("calls and concurrency must be at least 1, warmup at least 0")
    if client not in CLIENTS:
        raise ValueError(f"client must be one of {CLIENTS}, got {client!r}")
    card = model_card(build_tokenizer())
    engine = ZeroCostEngine()
    generate = EngineBackend(engine)
    messages = agent_messages(prompt_messages)
    budget = Budget(max_calls=10**6, token_budget=10**9, time_limit_s=1e6, max_inflight=max(8, concurrency))
    first = chat_body(card.name, messages, 0)
    prompt, params = engine_call(card, first, budget.max_tokens_per_call, "bench", 0)
    rounds = warmup + calls
    seconds: dict[str, list[float]] = {"direct": [], "proxied": [], "floor": []}
    result: dict = {"client": client, "calls": calls, "warmup": warmup, "prompt_messages": len(messages),
                    "tools": len(TOOLS), "prompt_tokens": len(prompt), "request_bytes": len(json.dumps(first).encode()),
                    "concurrency": concurrency, "cpus": os.cpu_count()}
    with ProxyThread(card) as px, contextlib.ExitStack() as stack:
        loop = asyncio.new_event_loop()  # the direct path's, in this thread
        stack.callback(loop.close)
        session = px.open("bench", generate, budget=budget)
        env = px.environment(session)
        # Call 0, untimed: the proxy's reply as bytes, for the floor to answer with (so the floor's
        # client reads, and the SDK parses, the same bytes), and the engine call it made, which
        # must be the one the direct path makes.
        raw = HttpClient(env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"])
        fixed = raw.call(first)
        raw.close()
        if not np.array_equal(engine.last.prompt_ids, prompt) or engine.last.params != params:
            raise AssertionError("the proxy's engine call differs from the direct path's")
        result["response_bytes"] = len(fixed)
        to_proxy = make_client(client, env["OPENAI_BASE_URL"], env["OPENAI_API_KEY"])
        stack.callback(to_proxy.close)
        paths = {
            "direct": lambda i, body: loop.run_until_complete(direct_call(generate, engine, prompt, params, i)),
            "proxied": lambda i, body: http_call(to_proxy, body, engine),
        }
        if floor:
            server = stack.enter_context(FloorServer(fixed))
            to_floor = make_client(client, server.base_url, "floor")
            stack.callback(to_floor.close)
            paths["floor"] = lambda i, body: http_call(to_floor, body)
        order = list(paths)
        for i in range(1, rounds + 1):
            body = chat_body(card.name, messages, i)
            turn = i % len(order)
            for name in order[turn:] + order[:turn]:
                took = paths[name](i, body)
                if i > warmup:
                    seconds[name].append(took)
        last_prompt, last_params = engine_call(card, chat_body(card.name, messages, rounds), budget.max_tokens_per_call,
                                               "bench", rounds)
        served = engine.last_of[session.execution_id]
        if not np.array_equal(served.prompt_ids, last_prompt) or served.params != last_params:
            raise AssertionError("the proxy's engine call differs from the request's rendering")
        expected_records = rounds + 1
        concurrent = None
        if concurrency > 1:
            more = px.open("bench-concurrent", generate, budget=budget)
            took, wall = time_concurrent(client, px.server.base_url(more), more.secret, card.name, messages,
                                         range(rounds + 1, rounds + 1 + calls), concurrency)
            concurrent = summarise(took, wall) | {"threads": concurrency}
            expected_records += calls
            # Closing goes through the proxy's loop: every record made before it is in.
            records = len(px.close("bench").records) + len(px.close("bench-concurrent").records)
        else:
            records = len(px.close("bench").records)
    expected_engine = expected_records + rounds
    result |= {"engine_calls": engine.calls, "expected_engine_calls": expected_engine, "records": records,
               "expected_records": expected_records}
    if engine.calls != expected_engine or records != expected_records:
        raise AssertionError(f"{expected_records} proxied and {rounds} direct calls: the engine served {engine.calls}, "
                             f"the proxy recorded {records}")

    d, p = summarise(seconds["direct"]), summarise(seconds["proxied"])
    f = summarise(seconds["floor"]) if floor else None
    result |= {
        "direct": d, "proxied": p, "floor": f, "concurrent": concurrent,
        "added_p50_ms": p["p50_ms"] - d["p50_ms"], "added_p99_ms": p["p99_ms"] - d["p99_ms"],
        "ratio_p50": p["p50_ms"] / d["p50_ms"], "ratio_mean": p["mean_ms"] / d["mean_ms"],
        "proxy_logic_p50_ms": p["p50_ms"] - f["p50_ms"] if f else None,
        "target_added_p50_ms": TARGET_ADDED_P50_MS,
    }
    result["target_met"] = result["added_p50_ms"] <= TARGET_ADDED_P50_MS
    return result


def format_proxy(result: dict) -> str:
    """A table of the paths' per-call latencies and the lines ``added p50``, ``proxied / direct``."""
    r = result
    lines = [
        f"latency the gyreflow proxy adds per call: zero-cost engine, client {r['client']}, "
        f"{r['calls']} timed calls (+{r['warmup']} warm-up) per path",
        f"request: chat completion, {r['prompt_messages']} messages, {r['tools']} tools, "
        f"{r['prompt_tokens']} prompt tokens, {r['request_bytes']} bytes"
        + (f"; reply {r['response_bytes']} bytes" if r.get("response_bytes") else ""),
        "",
        f"{'path':<24} {'p50':>9} {'p99':>9} {'mean':>9} {'min':>9} {'calls/s':>9}",
    ]
    rows = [("direct engine call", r["direct"]), (f"proxied ({r['client']})", r["proxied"])]
    if r.get("floor"):
        rows.append((f"HTTP floor ({r['client']})", r["floor"]))
    if r.get("concurrent"):
        rows.append((f"proxied, {r['concurrent']['threads']} threads", r["concurrent"]))
    for name, f in rows:
        lines.append(f"{name:<24} {f['p50_ms']:>6.3f} ms {f['p99_ms']:>6.3f} ms {f['mean_ms']:>6.3f} ms "
                     f"{f['min_ms']:>6.3f} ms {f['calls_per_s']:>9.0f}")
    lines += [
        "",
        f"checks: every call reached the engine once ({r['engine_calls']} engine calls, direct ones included); "
        f"{r['records']} records for {r['expected_records']} proxied calls",
        f"the proxy runs on its own thread, the client in this one: they share this machine's {r['cpus']} CPUs, "
        "as a proxy serving a local agent does",
        "",
        f"added by the proxy: p50 {r['added_p50_ms']:.3f} ms, p99 {r['added_p99_ms']:.3f} ms "
        f"(target p50 <= {r['target_added_p50_ms']:.1f} ms: {'met' if r['target_met'] else 'NOT MET'})",
        f"proxied / direct: {r['ratio_p50']:.1f}x at p50, {r['ratio_mean']:.1f}x on the mean",
    ]
    if r.get("floor"):
        p50, floor = r["proxied"]["p50_ms"], r["floor"]["p50_ms"]
        lines.append(f"proxied / HTTP floor: {p50 / floor:.2f}x at p50: of the proxied {p50:.3f} ms, {floor:.3f} ms "
                     f"are HTTP, tornado and the client, {r['proxy_logic_p50_ms']:.3f} ms the proxy's own logic")
    if r["client"] != "http":
        lines.append(f"the {r['client']} client's own cost is part of the added latency (see the floor); "
                     "the proxy's is best read with the http client")
    if r.get("concurrent"):
        c = r["concurrent"]
        lines.append(f"calls/s with {c['threads']} threads / sequential: "
                     f"{c['calls_per_s'] / r['proxied']['calls_per_s']:.2f}x")
    return "\n".join(lines)
