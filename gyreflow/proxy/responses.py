"""Replies as OpenAI response objects, and as server-sent events when streamed.

Streams follow the event order the official SDK's stream parsers expect. Text may be streamed
while the call runs (:func:`text_delta`, see :mod:`gyreflow.proxy.streaming`); the rest of a
stream is produced from the finished reply.
"""

from __future__ import annotations

import json
from typing import Iterator

from gyreflow.proxy.calls import ModelCard
from gyreflow.proxy.requests import CallSpec
from gyreflow.proxy.sessions import Reply

PIECE = 24
"""Characters of text per streamed delta."""


def _pieces(text: str) -> list[str]:
    return [text[i:i + PIECE] for i in range(0, len(text), PIECE)]


def _usage(reply: Reply) -> dict:
    p, c = len(reply.prompt_ids), len(reply.result.completion_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _token_logprobs(reply: Reply, card: ModelCard) -> list[dict]:
    out = []
    for tok, lp in zip(reply.result.completion_ids, reply.result.logprobs):
        raw = card.renderer.token_bytes(int(tok))
        out.append({"token": raw.decode("utf-8", errors="replace"), "logprob": float(lp), "bytes": list(raw),
                    "top_logprobs": []})
    return out


def _ids(reply: Reply) -> dict:
    return {"prompt_token_ids": [int(t) for t in reply.prompt_ids],
            "token_ids": [int(t) for t in reply.result.completion_ids]}


def _reply_id(reply: Reply, prefix: str) -> str:
    # Derived from the engine request id, so a retry that gets the same reply sees the same id.
    return prefix + (reply.request_id or reply.result.request_id).replace("/", "-")


# -- chat completions ---------------------------------------------------------------------------

def chat_completion(reply: Reply, spec: CallSpec, card: ModelCard) -> dict:
    message = {"role": "assistant", "content": reply.content if reply.content or not reply.tool_calls else None}
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    choice = {"index": 0, "message": message, "finish_reason": reply.finish_reason,
              "logprobs": {"content": _token_logprobs(reply, card)} if spec.logprobs else None}
    out = {"id": _reply_id(reply, "chatcmpl-"), "object": "chat.completion", "created": reply.created,
           "model": card.name, "choices": [choice], "usage": _usage(reply), "system_fingerprint": None}
    if spec.return_token_ids:
        out.update(_ids(reply))
    return out


def chat_chunks(reply: Reply, spec: CallSpec, card: ModelCard) -> Iterator[dict]:
    base = {"id": _reply_id(reply, "chatcmpl-"), "object": "chat.completion.chunk", "created": reply.created,
            "model": card.name, "system_fingerprint": None}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return base | {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}

    yield chunk({"role": "assistant", "content": ""})
    for piece in _pieces(reply.content):
        yield chunk({"content": piece})
    for i, call in enumerate(reply.tool_calls):
        fn = call["function"]
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": fn["name"], "arguments": ""}}]})
        for piece in _pieces(fn["arguments"]):
            yield chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    last = chunk({}, reply.finish_reason)
    if spec.return_token_ids:
        last.update(_ids(reply))
    yield last
    if spec.include_usage:
        yield base | {"choices": [], "usage": _usage(reply)}


def text_delta(endpoint: str, reply: Reply, card: ModelCard, text: str) -> dict:
    """One piece of text of a call still running, as a chunk of ``endpoint``'s stream."""
    if endpoint == "chat":
        return {"id": _reply_id(reply, "chatcmpl-"), "object": "chat.completion.chunk", "created": reply.created,
                "model": card.name, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None, "logprobs": None}]}
    return {"id": _reply_id(reply, "cmpl-"), "object": "text_completion", "created": reply.created, "model": card.name,
            "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}]}


LIVE_ENDPOINTS = ("chat", "completions")
"""Endpoints whose text is streamed as it is sampled (when the call has no tools to parse)."""


# -- completions --------------------------------------------------------------------------------

def _completion_logprobs(reply: Reply, card: ModelCard) -> dict:
    toks = _token_logprobs(reply, card)
    offsets, pos = [], 0
    for t in toks:
        offsets.append(pos)
        pos += len(t["token"])
    return {"tokens": [t["token"] for t in toks], "token_logprobs": [t["logprob"] for t in toks],
            "top_logprobs": None, "text_offset": offsets}


def text_completion(reply: Reply, spec: CallSpec, card: ModelCard) -> dict:
    choice = {"index": 0, "text": reply.content, "finish_reason": reply.finish_reason,
              "logprobs": _completion_logprobs(reply, card) if spec.logprobs else None}
    out = {"id": _reply_id(reply, "cmpl-"), "object": "text_completion", "created": reply.created,
           "model": card.name, "choices": [choice], "usage": _usage(reply)}
    if spec.return_token_ids:
        out.update(_ids(reply))
    return out


def completion_chunks(reply: Reply, spec: CallSpec, card: ModelCard) -> Iterator[dict]:
    base = {"id": _reply_id(reply, "cmpl-"), "object": "text_completion", "created": reply.created, "model": card.name}
    for piece in _pieces(reply.content):
        yield base | {"choices": [{"index": 0, "text": piece, "finish_reason": None, "logprobs": None}]}
    yield base | {"choices": [{"index": 0, "text": "", "finish_reason": reply.finish_reason, "logprobs": None}]}
    if spec.include_usage:
        yield base | {"choices": [], "usage": _usage(reply)}


# -- responses ----------------------------------------------------------------------------------

def _output_items(reply: Reply) -> list[dict]:
    items = []
    if reply.content or not reply.tool_calls:
        items.append({"type": "message", "id": "msg_" + reply.response_id[5:], "status": "completed",
                      "role": "assistant",
                      "content": [{"type": "output_text", "text": reply.content, "annotations": [], "logprobs": []}]})
    for call in reply.tool_calls:
        items.append({"type": "function_call", "id": "fc_" + call["id"][5:], "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def response_object(reply: Reply, spec: CallSpec, card: ModelCard, status: str | None = None) -> dict:
    p, c = len(reply.prompt_ids), len(reply.result.completion_ids)
    done = status is None
    status = status or ("incomplete" if reply.finish_reason == "length" else "completed")
    out = {"id": reply.response_id, "object": "response", "created_at": reply.created, "status": status,
           "model": card.name, "output": _output_items(reply) if done else [],
           "parallel_tool_calls": True, "tool_choice": spec.tool_choice if isinstance(spec.tool_choice, str)
           else {"type": "function", "name": spec.tool_choice[1]},
           "tools": [t["function"] | {"type": "function"} for t in spec.tools],
           "temperature": spec.temperature, "top_p": spec.top_p, "error": None,
           "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
           "instructions": None, "metadata": {}, "previous_response_id": spec.previous_response_id,
           "usage": {"input_tokens": p, "output_tokens": c, "total_tokens": p + c,
                     "input_tokens_details": {"cached_tokens": 0},
                     "output_tokens_details": {"reasoning_tokens": 0}} if done else None}
    if spec.return_token_ids and done:
        out.update(_ids(reply))
    return out


def response_events(reply: Reply, spec: CallSpec, card: ModelCard) -> Iterator[dict]:
    seq = iter(range(1 << 30))

    def event(kind: str, **fields) -> dict:
        return {"type": kind, "sequence_number": next(seq), **fields}

    yield event("response.created", response=response_object(reply, spec, card, status="in_progress"))
    yield event("response.in_progress", response=response_object(reply, spec, card, status="in_progress"))
    for index, item in enumerate(_output_items(reply)):
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield event("response.output_item.added", output_index=index,
                        item=item | {"status": "in_progress", "content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)
            for piece in _pieces(text):
                yield event("response.output_text.delta", item_id=item["id"], output_index=index, content_index=0,
                            delta=piece, logprobs=[])
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=text, logprobs=[])
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part | {"text": text})
        else:
            yield event("response.output_item.added", output_index=index,
                        item=item | {"status": "in_progress", "arguments": ""})
            for piece in _pieces(item["arguments"]):
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=piece)
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"], name=item["name"])
        yield event("response.output_item.done", output_index=index, item=item)
    final = response_object(reply, spec, card)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)


def sse(data: dict, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(data, ensure_ascii=False) + "\n\n").encode("utf-8")


BUILDERS = {
    "chat": (chat_completion, chat_chunks),
    "completions": (text_completion, completion_chunks),
    "responses": (response_object, response_events),
}
