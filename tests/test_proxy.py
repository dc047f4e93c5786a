"""The OpenAI-compatible proxy with the official ``openai`` SDK and raw HTTP, over a real engine.

Every recorded call is checked against the engine's own record of what it consumed and sampled.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from urllib.parse import urlparse

import numpy as np
import openai
import pytest

from gyreflow.model import build_tokenizer
from gyreflow.proxy.calls import model_card
from gyreflow.proxy.local import ProxyThread
from gyreflow.proxy.sessions import Budget, SamplingPin
from gyreflow.trajectory.records import ExecutionResult
from gyreflow.trajectory.tree import build_tree
from gyreflow.model import build_policy
from proxy_support import CALL_TEXT, FINAL_TEXT, SMALL, TASK, TOOLS, Journal, start_engine, train_tool_model

MODEL = "gyreflow-policy"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def engine(one_torch_thread):
    runner = start_engine(train_tool_model())
    yield runner
    runner.stop()


@pytest.fixture(scope="module")
def proxy(tok):
    with ProxyThread(model_card(tok, MODEL), max_body_bytes=1 << 16) as px:
        yield px


_count = iter(range(10**6))


class Exec:
    """A session opened for one test, with its journal and clients."""

    def __init__(self, proxy, engine, *, delay_s=0.0, budget=None, seed=7, pin=None):
        self.journal = Journal(engine, delay_s)
        self.id = f"exec-{next(_count)}"
        self.session = proxy.open(self.id, self.journal, budget=budget, seed=seed, pin=pin)
        self.env = proxy.environment(self.session)
        self.proxy = proxy

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.env["OPENAI_BASE_URL"], api_key=self.env["OPENAI_API_KEY"], **kw)

    def aclient(self, **kw) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.env["OPENAI_BASE_URL"], api_key=self.env["OPENAI_API_KEY"], **kw)

    @property
    def records(self):
        return self.session.records

    def post(self, path, body, headers=None, key=None, base=None):
        """Raw HTTP: (status, headers, parsed JSON or raw bytes)."""
        url = urlparse(base or self.env["OPENAI_BASE_URL"])
        conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h = {"Authorization": f"Bearer {key or self.env['OPENAI_API_KEY']}", "Content-Type": "application/json"}
        conn.request("POST", url.path + path, body=data, headers=h | (headers or {}))
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        try:
            return resp.status, dict(resp.getheaders()), json.loads(raw)
        except ValueError:
            return resp.status, dict(resp.getheaders()), raw


def assert_recorded_exactly(ex: Exec) -> None:
    """Each record is one engine call: the prompt it consumed and what it sampled, bit for bit."""
    served = {req.request_id: (req, res) for req, res in ex.journal.served}
    assert ex.records, "nothing was recorded"
    for rec in ex.records:
        req, res = served[rec.call_id]
        np.testing.assert_array_equal(rec.prompt_ids, np.asarray(req.prompt_ids))
        np.testing.assert_array_equal(rec.prompt_ids, res.prompt_ids)
        np.testing.assert_array_equal(rec.completion_ids, res.completion_ids)
        np.testing.assert_array_equal(rec.logprobs, res.logprobs)
        np.testing.assert_array_equal(rec.versions, res.versions)
        assert rec.execution_id == ex.id and rec.finish_reason == res.finish_reason


def rendered(tok, messages, tools=None) -> list[int]:
    """The prompt ids of ``messages`` by the tokenizer alone: its template, then its encoder."""
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def user(text="hello there"):
    return [{"role": "user", "content": text}]


# -- endpoints with the SDK ---------------------------------------------------------------------

def test_models(proxy, engine):
    ex = Exec(proxy, engine)
    c = ex.client()
    assert [m.id for m in c.models.list()] == [MODEL]
    assert c.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


def test_chat_sync_records_what_the_engine_consumed_and_sampled(proxy, engine, tok):
    ex = Exec(proxy, engine)
    r = ex.client().chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "be brief"}] + user(),
                                            max_tokens=12, temperature=1.0, logprobs=True)
    assert len(ex.records) == 1 and len(ex.journal.served) == 1
    assert_recorded_exactly(ex)
    rec = ex.records[0]
    expect = rendered(tok, [{"role": "system", "content": "be brief"}] + user())
    assert rec.prompt_ids.tolist() == list(expect)
    assert r.usage.prompt_tokens == len(rec.prompt_ids) and r.usage.completion_tokens == len(rec.completion_ids)
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(rec.logprobs.tolist())
    assert r.choices[0].message.content == tok.decode(rec.completion_ids, skip_special_tokens=True)


def test_chat_async_concurrent_calls(proxy, engine):
    ex = Exec(proxy, engine)

    async def main():
        c = ex.aclient()
        outs = await asyncio.gather(*[c.chat.completions.create(model=MODEL, messages=user(f"task {i}"), max_tokens=8)
                                      for i in range(4)])
        await c.close()
        return outs

    outs = asyncio.run(main())
    assert len({o.id for o in outs}) == 4
    assert len(ex.records) == 4 and sorted(r.call_index for r in ex.records) == [0, 1, 2, 3]
    assert_recorded_exactly(ex)


def test_chat_stream_with_usage(proxy, engine, tok):
    ex = Exec(proxy, engine)
    chunks = list(ex.client().chat.completions.create(model=MODEL, messages=user(), max_tokens=40, stream=True,
                                                      stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(ex.records) == 1
    rec = ex.records[0]
    assert text == tok.decode(rec.completion_ids, skip_special_tokens=True)
    assert finish == ["length" if rec.finish_reason == "length" else "stop"]
    assert chunks[-1].usage.completion_tokens == len(rec.completion_ids) and not chunks[-1].choices
    assert_recorded_exactly(ex)


def test_stream_carries_tokens_as_they_are_sampled(proxy, engine, tok):
    """A 500-token generation streams its text while it runs: the first piece arrives long before
    the last, and the pieces make up exactly the recorded completion."""
    ex = Exec(proxy, engine)
    t0 = time.monotonic()
    arrivals, pieces = [], []
    for ch in ex.client().chat.completions.create(model=MODEL, messages=user(), max_tokens=500, temperature=1.0,
                                                   stream=True, extra_body={"ignore_eos": True}):
        if ch.choices and ch.choices[0].delta.content:
            arrivals.append(time.monotonic() - t0)
            pieces.append(ch.choices[0].delta.content)
    rec = ex.records[0]
    assert len(rec.completion_ids) == 500
    assert "".join(pieces) == tok.decode(rec.completion_ids, skip_special_tokens=True)
    assert len(pieces) > 50 and arrivals[0] < 0.25 * arrivals[-1]
    assert_recorded_exactly(ex)


@pytest.fixture(scope="module")
def untrained_engine(one_torch_thread):
    runner = start_engine(build_policy(SMALL, seed=3))
    yield runner
    runner.stop()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "go"}}])
def test_forced_tool_calls_always_parse(proxy, untrained_engine, choice):
    """With tool_choice "required" or a named function, decoding follows the call format: even a
    policy that never saw a tool call answers every time with a call of an allowed tool."""
    ex = Exec(proxy, untrained_engine)
    c = ex.client()
    names = []
    for i in range(8):
        r = c.chat.completions.create(model=MODEL, messages=user(f"task {i}"), tools=TOOLS, tool_choice=choice,
                                      temperature=1.0, max_tokens=40 + 8 * i)
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name in {"go", "read"} and isinstance(json.loads(call.function.arguments), dict)
        names.append(call.function.name)
    if choice != "required":
        assert set(names) == {"go"}
    with pytest.raises(openai.BadRequestError):  # too few tokens for any call
        c.chat.completions.create(model=MODEL, messages=user(), tools=TOOLS, tool_choice=choice, max_tokens=3)
    assert_recorded_exactly(ex)


def test_tool_calls_and_history_restored_token_exact(proxy, engine):
    """The model calls a tool; the agent sends the call back re-formatted; the next prompt holds
    the ids the model really sampled, so the two calls share one path in the trajectory tree."""
    ex = Exec(proxy, engine)
    c = ex.client()
    messages = [{"role": "user", "content": TASK}]
    r1 = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=80)
    msg = r1.choices[0].message
    assert r1.choices[0].finish_reason == "tool_calls"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in msg.tool_calls] == [("go", {"door": "a"})]
    assert msg.content is None
    # The harness re-serializes: no spaces in the arguments, content null -> omitted.
    call = msg.tool_calls[0]
    messages += [{"role": "assistant", "tool_calls": [{"id": call.id, "type": "function",
                                                        "function": {"name": "go", "arguments": '{"door":"a"}'}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "opened"}]
    r2 = c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0, max_tokens=80)
    assert r2.choices[0].message.content == FINAL_TEXT and r2.choices[0].finish_reason == "stop"
    first, second = ex.records
    turn = np.concatenate([first.prompt_ids, first.completion_ids])
    np.testing.assert_array_equal(second.prompt_ids[: len(turn)], turn)
    assert_recorded_exactly(ex)
    result = ExecutionResult(ex.id, "t", 0, 0, "train", list(ex.records), 1.0, True, "done")
    assert len(build_tree(result).paths()) == 1  # one path: the history is the model's own


def test_unknown_tool_call_ids_are_rendered_as_sent(proxy, engine, tok):
    ex = Exec(proxy, engine)
    messages = [{"role": "user", "content": TASK},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_elsewhere", "type": "function", "function": {"name": "go", "arguments": '{"door":"b"}'}}]},
                {"role": "tool", "tool_call_id": "call_elsewhere", "content": "locked"}]
    ex.client().chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    expect = rendered(tok, messages, TOOLS)
    assert ex.records[0].prompt_ids.tolist() == list(expect)


def test_tool_call_stream(proxy, engine):
    ex = Exec(proxy, engine)
    chunks = list(ex.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TASK}],
                                                      tools=TOOLS, temperature=0, max_tokens=80, stream=True))
    calls: dict[int, dict] = {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            c["id"] = d.id or c["id"]
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("go", {"door": "a"})]
    assert calls[0]["id"].startswith("call_")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert_recorded_exactly(ex)


def test_tool_choice_required_and_named_force_a_call(proxy, engine, tok):
    ex = Exec(proxy, engine)
    c = ex.client()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TASK}], tools=TOOLS,
                                  tool_choice="required", temperature=0, max_tokens=80)
    assert r.choices[0].message.tool_calls[0].function.name == "go"
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TASK}], tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "go"}}, temperature=0,
                                  max_tokens=80)
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"door": "a"}
    named = ex.records[1]
    forced = tok.encode('<tool_call>{"name": "go", "arguments": ', add_special_tokens=False)
    assert named.prompt_ids[-len(forced):].tolist() == forced  # the forced prefix is part of what was consumed
    assert_recorded_exactly(ex)


def test_stop_sequences_and_content_parts(proxy, engine, tok):
    ex = Exec(proxy, engine)
    r = ex.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "open "},
                                                            {"type": "text", "text": "door a"}]}],
        tools=TOOLS, temperature=0, max_tokens=80, stop=["door"])
    rec = ex.records[0]
    assert tok.decode(rec.completion_ids).endswith("door")  # sampled and recorded with the stop string
    assert r.choices[0].message.content == CALL_TEXT[: CALL_TEXT.index("door")]  # returned without it
    assert r.choices[0].finish_reason == "stop"


def test_completions_text_and_token_ids(proxy, engine, tok):
    ex = Exec(proxy, engine)
    c = ex.client()
    r = c.completions.create(model=MODEL, prompt="abc", max_tokens=6, logprobs=1)
    assert ex.records[0].prompt_ids.tolist() == tok.encode("abc", add_special_tokens=False)
    assert r.choices[0].logprobs.token_logprobs == pytest.approx(ex.records[0].logprobs.tolist())
    c.completions.create(model=MODEL, prompt=[97, 98, 99, 256 + 3], max_tokens=6)
    assert ex.records[1].prompt_ids.tolist() == [97, 98, 99, 259]
    chunks = list(c.completions.create(model=MODEL, prompt="xyz", max_tokens=6, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == tok.decode(ex.records[2].completion_ids,
                                                                                     skip_special_tokens=True)
    assert_recorded_exactly(ex)


def test_calls_record_their_sampling_settings_and_a_pinned_session_overrides_them(proxy, engine):
    ex = Exec(proxy, engine)
    c = ex.client()
    c.chat.completions.create(model=MODEL, messages=user(), temperature=0, max_tokens=6)
    c.chat.completions.create(model=MODEL, messages=user("again"), temperature=0.7, top_p=0.5, max_tokens=6)
    asked = [(0.0, 1.0), (0.7, 0.5)]
    assert [(r.temperature, r.top_p) for r in ex.records] == asked
    assert [(q.params.temperature, q.params.top_p) for q, _ in ex.journal.served] == asked
    result = ExecutionResult(ex.id, "t", 0, 0, "train", ex.records, 1.0, True, "done")
    assert build_tree(result).n_samples == 0  # greedy and nucleus calls are context, not samples

    pinned = Exec(proxy, engine, pin=SamplingPin(temperature=1.0, top_p=1.0))
    pinned.client().chat.completions.create(model=MODEL, messages=user(), temperature=0, top_p=0.5, max_tokens=6)
    (rec,) = pinned.records
    assert (rec.temperature, rec.top_p) == (1.0, 1.0)
    assert [(q.params.temperature, q.params.top_p) for q, _ in pinned.journal.served] == [(1.0, 1.0)]
    result = ExecutionResult(pinned.id, "t", 0, 0, "train", pinned.records, 1.0, True, "done")
    assert build_tree(result).n_samples == len(rec.completion_ids) > 0
    assert_recorded_exactly(pinned)


def test_responses_text_function_calls_and_stream(proxy, engine, tok):
    ex = Exec(proxy, engine)
    c = ex.client()
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    r1 = c.responses.create(model=MODEL, input=TASK, tools=tools, temperature=0, max_output_tokens=80)
    calls = [o for o in r1.output if o.type == "function_call"]
    assert [(o.name, json.loads(o.arguments)) for o in calls] == [("go", {"door": "a"})]
    # Continue with the function's output, the way Responses clients do without stored state.
    items = [{"role": "user", "content": TASK},
             {"type": "function_call", "call_id": calls[0].call_id, "name": "go", "arguments": '{"door":"a"}'},
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": "opened"}]
    r2 = c.responses.create(model=MODEL, input=items, tools=tools, temperature=0, max_output_tokens=80)
    assert r2.output_text == FINAL_TEXT and r2.status == "completed"
    first, second = ex.records
    turn = np.concatenate([first.prompt_ids, first.completion_ids])
    np.testing.assert_array_equal(second.prompt_ids[: len(turn)], turn)
    # The same continuation through previous_response_id.
    r3 = c.responses.create(model=MODEL, previous_response_id=r1.id, tools=tools, temperature=0, max_output_tokens=80,
                            input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "opened"}])
    np.testing.assert_array_equal(ex.records[2].prompt_ids, second.prompt_ids)
    assert r3.output_text == FINAL_TEXT
    # Streamed.
    with c.responses.stream(model=MODEL, input=TASK, tools=tools, temperature=0,
                            max_output_tokens=80) as stream:
        kinds = [ev.type for ev in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.done" in kinds
    assert [o.name for o in final.output if o.type == "function_call"] == ["go"]
    # Instructions are the system message.
    c.responses.create(model=MODEL, input="hi", instructions="act", max_output_tokens=4)
    assert ex.records[4].prompt_ids.tolist() == rendered(tok, [{"role": "system", "content": "act"}] + user("hi"))
    assert_recorded_exactly(ex)


def test_raw_http_token_ids_match_records(proxy, engine):
    ex = Exec(proxy, engine)
    status, headers, body = ex.post("/chat/completions", {"model": MODEL, "messages": user(), "max_tokens": 8,
                                                          "return_token_ids": True})
    assert status == 200 and body["object"] == "chat.completion"
    rec = ex.records[0]
    assert body["prompt_token_ids"] == rec.prompt_ids.tolist() and body["token_ids"] == rec.completion_ids.tolist()
    assert_recorded_exactly(ex)


def test_flattened_history_is_recorded_as_given(proxy, engine, tok):
    """A client that replays earlier calls as plain text: the next prompt is not the previous
    prompt plus its completion, and it is recorded as sent."""
    ex = Exec(proxy, engine)
    c = ex.client()
    r1 = c.chat.completions.create(model=MODEL, messages=user("step one"), max_tokens=10)
    flat = [{"role": "user", "content": f"step one\n[assistant said] {r1.choices[0].message.content}\n"
                                        "[tool said] ok\nstep two"}]
    c.chat.completions.create(model=MODEL, messages=flat, max_tokens=10)
    first, second = ex.records
    assert second.prompt_ids.tolist() == rendered(tok, flat)
    turn = np.concatenate([first.prompt_ids, first.completion_ids])
    assert len(second.prompt_ids) < len(turn) or not np.array_equal(second.prompt_ids[: len(turn)], turn)
    assert_recorded_exactly(ex)


# -- retries ------------------------------------------------------------------------------------

def test_retry_of_a_delivered_call_is_not_recorded_twice(proxy, engine):
    ex = Exec(proxy, engine)
    body = {"model": MODEL, "messages": user(), "max_tokens": 8}
    s1, _, b1 = ex.post("/chat/completions", body)
    s2, _, b2 = ex.post("/chat/completions", body, headers={"x-stainless-retry-count": "1"})
    assert s1 == s2 == 200 and b1 == b2
    assert len(ex.journal.served) == 1 and len(ex.records) == 1
    # The same request again, not marked as a retry, is a deliberate new sample.
    s3, _, b3 = ex.post("/chat/completions", body)
    assert s3 == 200 and b3["id"] != b1["id"]
    assert len(ex.journal.served) == 2 and len(ex.records) == 2
    assert_recorded_exactly(ex)


def test_sdk_retries_after_a_timeout_make_one_call(proxy, engine):
    """The SDK times out and sends the same request again while the engine still works on it:
    the retries join the running call; one engine call, one record."""
    ex = Exec(proxy, engine, delay_s=1.0)
    r = ex.client(timeout=0.4, max_retries=5).chat.completions.create(model=MODEL, messages=user(), max_tokens=8)
    assert len(ex.journal.served) == 1 and len(ex.records) == 1
    assert r.usage.completion_tokens == len(ex.records[0].completion_ids)
    assert_recorded_exactly(ex)


# -- bad input: an OpenAI-style 4xx, nothing recorded, the server keeps serving ----------------

BAD = [
    (b'{"model": "gyreflow-policy", "messages": [', 400, None),
    ({"model": MODEL, "messages": "hello"}, 400, "messages"),
    ({"model": MODEL, "messages": user(), "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "messages": user(), "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": user(), "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content"),
    ({"model": MODEL, "messages": user(), "n": 3}, 400, "n"),
    ({"model": "gpt-4o", "messages": user()}, 404, "model"),
    ({"model": MODEL, "messages": user(), "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400,
     "tools"),
    ({"model": MODEL, "messages": user(), "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "array"}}}]}, 400, "tools"),
    ({"model": MODEL, "messages": user(), "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"model": MODEL, "messages": user(), "tools": TOOLS, "tool_choice": {"type": "function",
                                                                          "function": {"name": "fly"}}}, 400,
     "tool_choice"),
    ([1, 2, 3], 400, None),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_input_is_refused_and_nothing_recorded(proxy, engine, body, status, param):
    ex = Exec(proxy, engine)
    code, _, out = ex.post("/chat/completions", body)
    assert code == status, out
    assert set(out["error"]) >= {"message", "type", "param", "code"} and out["error"]["message"]
    if param:
        assert out["error"]["param"] == param
    assert not ex.records and not ex.journal.served
    ok = ex.client().chat.completions.create(model=MODEL, messages=user(), max_tokens=4)
    assert ok.choices and len(ex.records) == 1


def test_bad_input_through_the_sdk(proxy, engine):
    ex = Exec(proxy, engine)
    c = ex.client(max_retries=0)
    with pytest.raises(openai.NotFoundError) as err:
        c.chat.completions.create(model="gpt-4o", messages=user())
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=user(), tools=[{"type": "function", "function": {"name": ""}}])
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model=MODEL, input=[{"type": "mystery"}])
    assert not ex.records and not ex.journal.served


def test_oversized_body(proxy, engine):
    ex = Exec(proxy, engine)
    code, _, out = ex.post("/chat/completions", {"model": MODEL, "messages": user("x" * (1 << 17))})
    assert code == 413 and out["error"]["code"] == "request_too_large"
    # Far past any buffer: 100 MiB, 1,600 times the limit, still gets the 413 (not a cut connection).
    code, _, out = ex.post("/chat/completions", {"model": MODEL, "messages": user("x" * (100 << 20))})
    assert code == 413 and out["error"]["code"] == "request_too_large"
    assert not ex.records and not ex.journal.served
    assert ex.client().chat.completions.create(model=MODEL, messages=user(), max_tokens=4).choices


def test_unknown_and_finished_sessions_are_refused(proxy, engine):
    ex = Exec(proxy, engine)
    bad = openai.OpenAI(base_url=ex.env["OPENAI_BASE_URL"], api_key="gf-not-a-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=user())
    code, _, _ = ex.post("/chat/completions", {"model": MODEL, "messages": user()},
                         base=ex.env["OPENAI_BASE_URL"].replace(ex.id, "exec-nobody"))
    assert code == 401
    c = ex.client(max_retries=0)
    c.chat.completions.create(model=MODEL, messages=user(), max_tokens=4)
    proxy.close(ex.id)
    with pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model=MODEL, messages=user(), max_tokens=4)
    assert len(ex.records) == 1 and len(ex.journal.served) == 1


def test_client_disconnect_mid_stream(proxy, engine):
    ex = Exec(proxy, engine, delay_s=0.5)
    url = urlparse(ex.env["OPENAI_BASE_URL"])
    body = json.dumps({"model": MODEL, "messages": user(), "max_tokens": 8, "stream": True}).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                     f"{ex.env['OPENAI_API_KEY']}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
                     f"\r\n\r\n".encode() + body)
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
    # Gone before the completion: the engine finishes it, but the agent never saw it.
    deadline = time.time() + 30
    while not ex.journal.served and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)
    assert len(ex.journal.served) == 1 and not ex.records
    r = ex.client().chat.completions.create(model=MODEL, messages=user("next"), max_tokens=4)
    assert r.choices and len(ex.records) == 1


# -- budgets and isolation ----------------------------------------------------------------------

def test_call_flood_is_bounded_by_the_budget(proxy, engine):
    ex = Exec(proxy, engine, budget=Budget(max_calls=3, max_tokens_per_call=8))
    c = ex.client(max_retries=3)
    for i in range(3):
        c.chat.completions.create(model=MODEL, messages=user(f"{i}"))
    with pytest.raises(openai.RateLimitError) as err:
        c.chat.completions.create(model=MODEL, messages=user("one more"))
    assert err.value.code == "budget_exhausted"
    assert err.value.response.headers["x-should-retry"] == "false"
    assert len(ex.journal.served) == 3 and len(ex.records) == 3
    assert ex.session.refused["budget"] == 1  # the SDK did not retry a spent budget
    assert all(len(r.completion_ids) <= 8 for r in ex.records)


def test_token_budget_cuts_max_tokens_then_refuses(proxy, engine):
    ex = Exec(proxy, engine, budget=Budget(token_budget=10, max_tokens_per_call=64))
    c = ex.client(max_retries=0)
    while True:
        try:
            c.chat.completions.create(model=MODEL, messages=user(f"{len(ex.records)}"), max_tokens=64)
        except openai.RateLimitError:
            break
    assert sum(len(r.completion_ids) for r in ex.records) == 10


def test_inflight_calls_are_bounded(proxy, engine):
    ex = Exec(proxy, engine, delay_s=0.5, budget=Budget(max_inflight=2))
    statuses = []

    def call(i):
        statuses.append(ex.post("/chat/completions", {"model": MODEL, "messages": user(f"{i}"), "max_tokens": 4})[0])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(statuses).count(200) >= 2 and set(statuses) <= {200, 429} and 429 in statuses
    assert len(ex.records) == statuses.count(200)


def test_sessions_are_isolated(proxy, engine):
    a, b = Exec(proxy, engine), Exec(proxy, engine)
    b.client().chat.completions.create(model=MODEL, messages=user(), max_tokens=4)
    before = [r.call_id for r in b.records]
    # A's key on B's base URL: refused, and B's records are untouched.
    code, _, out = a.post("/chat/completions", {"model": MODEL, "messages": user(), "max_tokens": 4},
                          base=b.env["OPENAI_BASE_URL"])
    assert code == 401 and out["error"]["type"] == "authentication_error"
    # A's key without a session path: served as A, recorded in A only.
    base = a.env["OPENAI_BASE_URL"].replace(f"/s/{a.id}", "")
    code, _, _ = a.post("/chat/completions", {"model": MODEL, "messages": user(), "max_tokens": 4}, base=base)
    assert code == 200 and len(a.records) == 1
    assert [r.call_id for r in b.records] == before
    # Tool-call ids served to B do not restore turns in A.
    assert not a.session.restored_turns([{"role": "assistant", "content": "", "tool_calls": [
        {"id": cid, "type": "function", "function": {"name": "go", "arguments": "{}"}} for cid in b.session.turns
        if isinstance(cid, str)]}])


def test_binds_to_loopback_by_default(proxy):
    assert {s.getsockname()[0] for s in proxy.server.sockets} == {"127.0.0.1"}
    assert urlparse(proxy.url).hostname == "127.0.0.1"


def test_turn_cache_encodes_exactly_as_the_whole_text(tok):
    """Rendering encodes one turn at a time and caches turns; the ids equal encoding the whole."""
    from gyreflow.proxy.render import ChatRenderer

    r = ChatRenderer(tok, cache_tokens=4096)
    assert r.piecewise
    rng = np.random.default_rng(0)
    alphabet = list("ab <|>end\n{}\"é✓") + ["<|end|>", "<|user|>", "<|tool|>"]
    for _ in range(50):
        text = "".join(rng.choice(alphabet, size=int(rng.integers(60, 400))))
        assert r.encode(text) == r._encode_whole(text) == r.encode(text)
    assert r._cached <= 4096


def test_prompt_longer_than_the_engine_holds(proxy, engine):
    """The engine's own refusal is the client's 400; the budget's in-flight slot is given back."""
    ex = Exec(proxy, engine, budget=Budget(max_inflight=1))
    c = ex.client(max_retries=0)
    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model=MODEL, messages=user("x" * 5000), max_tokens=4)
        assert err.value.code == "context_length_exceeded"
    assert not ex.records and ex.session.inflight == 0 and ex.session.calls_charged == 0
    assert c.chat.completions.create(model=MODEL, messages=user(), max_tokens=4).choices and len(ex.records) == 1


# -- found in review: each of these once went wrong ------------------------------------------

def test_concurrent_calls_share_the_token_budget(proxy, engine):
    """Calls running at once reserve their max_tokens: together they never exceed the budget."""
    ex = Exec(proxy, engine, delay_s=0.3, budget=Budget(token_budget=16, max_tokens_per_call=64, max_inflight=8))

    async def main():
        c = ex.aclient(max_retries=0)
        outs = await asyncio.gather(*[c.chat.completions.create(model=MODEL, messages=user(f"{i}"), max_tokens=64)
                                      for i in range(6)], return_exceptions=True)
        await c.close()
        return outs

    outs = asyncio.run(main())
    assert sum(len(r.completion_ids) for r in ex.records) <= 16
    assert any(isinstance(o, openai.RateLimitError) for o in outs)
    assert ex.session.tokens_reserved == 0 and ex.session.inflight == 0


def test_identical_requests_at_once_are_separate_samples(proxy, engine):
    """Best-of-n with identical parallel requests: n engine calls, n records (no retry mark)."""
    ex = Exec(proxy, engine, delay_s=0.3)
    body = {"model": MODEL, "messages": user(), "max_tokens": 6}
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(ex.post("/chat/completions", body))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [o[0] for o in outs] == [200] * 3 and len({o[2]["id"] for o in outs}) == 3
    assert len(ex.journal.served) == 3 and len(ex.records) == 3


def test_parallel_calls_split_over_messages_are_rendered_as_sent(proxy, engine, tok):
    """A turn's calls sent back in two assistant messages: neither is that turn, so the sampled
    turn is not spliced in (twice); the prompt is the messages as sent."""
    ex = Exec(proxy, engine)
    c = ex.client()
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": TASK}], tools=TOOLS,
                                  temperature=0, max_tokens=80)
    call = r.choices[0].message.tool_calls[0]
    ex.session.turns[call.id] = (frozenset({call.id, "call_other"}), ex.session.turns[call.id][1])
    messages = [{"role": "user", "content": TASK},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function",
                                                                      "function": {"name": "go", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": call.id, "content": "opened"}]
    c.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    assert ex.records[1].prompt_ids.tolist() == rendered(tok, messages, TOOLS)


def test_refused_stream_is_an_http_error_and_odd_content_renders(proxy, engine, tok):
    ex = Exec(proxy, engine, budget=Budget(max_calls=1))
    c = ex.client(max_retries=0)
    glyphs = "nerd font \ue000\ue001 glyphs and a NUL \x00 byte"
    chunks = list(c.chat.completions.create(model=MODEL, messages=user(glyphs), max_tokens=4, stream=True))
    assert chunks and ex.records[0].prompt_ids.tolist() == rendered(tok, user(glyphs))
    with pytest.raises(openai.RateLimitError):  # a real HTTP 429, not an error event inside a 200
        list(c.chat.completions.create(model=MODEL, messages=user(), max_tokens=4, stream=True))


@pytest.mark.parametrize("body,param", [
    ({"model": MODEL, "messages": user(), "temperature": 10 ** 400}, "temperature"),
    ({"model": MODEL, "messages": user(), "seed": 2 ** 64}, "seed"),
    ({"model": MODEL, "messages": user(), "tools": TOOLS, "tool_choice": {"type": "function", "function": "go"}},
     "tool_choice"),
])
def test_out_of_range_values_are_400s(proxy, engine, body, param):
    ex = Exec(proxy, engine)
    code, _, out = ex.post("/chat/completions", body)
    assert code == 400 and out["error"]["param"] == param and not ex.journal.served
    code, _, out = ex.post("/completions", {"model": MODEL, "prompt": [10 ** 30]})
    assert code == 400 and out["error"]["param"] == "prompt"
    assert ex.session.calls_started == 0


def test_null_tool_choice_and_pinned_seeds(proxy, engine):
    """A pinned client seed still gives each execution its own sample."""
    seeds = []
    for _ in range(4):
        ex = Exec(proxy, engine)
        r = ex.client().chat.completions.create(model=MODEL, messages=user(), tools=TOOLS, tool_choice=None,
                                                 max_tokens=12, seed=42)
        assert r.choices
        seeds.append(ex.journal.served[0][0].params.seed)
    assert len(set(seeds)) == 4


def test_previous_response_keeps_only_current_instructions(proxy, engine, tok):
    ex = Exec(proxy, engine)
    c = ex.client()
    r = c.responses.create(model=MODEL, input="one", instructions="act", max_output_tokens=4)
    for i in range(2):
        r = c.responses.create(model=MODEL, input=f"turn {i}", instructions="act", previous_response_id=r.id,
                               max_output_tokens=4)
    system = tok.convert_tokens_to_ids("<|system|>")
    assert ex.records[-1].prompt_ids.tolist().count(system) == 1
    assert ex.records[-1].prompt_ids.tolist()[0] == system


def test_logprob_bytes_are_the_tokens_own(proxy, engine, tok):
    """A token holding half of a UTF-8 character reports its own byte, not U+FFFD's."""
    ex = Exec(proxy, engine)
    r = ex.client().chat.completions.create(model=MODEL, messages=user(), max_tokens=24, logprobs=True)
    got = [b for t in r.choices[0].logprobs.content for b in t.bytes]
    rec = ex.records[0].completion_ids.tolist()
    want = [b for t in rec for b in (bytes([t]) if t < 256 else tok.convert_ids_to_tokens(t).encode())]
    assert got == want


def test_big_prompts_render_off_the_event_loop(tok):
    """A conversation past BIG_PROMPT_CHARS renders on a thread with a renderer of its own, to the
    same ids."""
    from gyreflow.proxy.calls import BIG_PROMPT_CHARS, prepare_call
    from gyreflow.proxy.requests import parse_chat
    from gyreflow.proxy.sessions import SessionRegistry

    card = model_card(tok, MODEL)
    session = SessionRegistry().open("big", generate=None)
    messages = user("é" * (BIG_PROMPT_CHARS // 2) + "x" * (BIG_PROMPT_CHARS // 2 + 1))

    prepared = asyncio.run(prepare_call(session, parse_chat({"model": MODEL, "messages": messages}), card))
    assert card._big is not None and card._big is not card.renderer
    assert prepared.prompt.tolist() == rendered(tok, messages)
