"""Request bodies of the three generation endpoints, validated and normalized into one
:class:`CallSpec`.

Validation is strict on the fields gyreflow acts on (a wrong type is a 400 naming the field) and
lenient on the rest: real clients send fields such as ``store``, ``metadata``, ``user`` or
``parallel_tool_calls`` that change nothing here.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from gyreflow.proxy.errors import bad_request

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ROLES = {"system", "user", "assistant", "tool"}
TEXT_PARTS = {"text", "input_text", "output_text"}

_NUMBER = (int, float)


@dataclass
class CallSpec:
    """One model call as the proxy acts on it, whatever endpoint it came from."""

    endpoint: str
    """``chat``, ``completions`` or ``responses``."""
    model: str
    messages: list[dict] | None = None
    """Normalized chat messages: ``role``, ``content`` (str), and ``tool_calls`` / ``tool_call_id``."""
    prompt_text: str | None = None
    """``/v1/completions``: the prompt as text ..."""
    prompt_ids: list[int] | None = None
    """... or as token ids."""
    tools: list[dict] = field(default_factory=list)
    """``[{"type": "function", "function": {"name", "description", "parameters"}}]``."""
    tool_choice: str | tuple[str, str] = "auto"
    """``auto``, ``none``, ``required`` or ``("function", name)``."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    return_token_ids: bool = False
    ignore_eos: bool = False
    """vLLM's extension: sample past the end-of-turn token, up to ``max_tokens``."""
    previous_response_id: str | None = None
    instructions: str | None = None
    """Responses API: the system message of this call only (never carried to the next response)."""


def _typed(body: dict, name: str, types, what: str, default: Any = None) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    # bool is an int in Python; a JSON true is never a number here.
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise bad_request(f"'{name}' must be {what}, got a boolean", param=name)
    if not isinstance(value, types):
        raise bad_request(f"'{name}' must be {what}, got {type(value).__name__}", param=name)
    return value


def _number(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    try:
        value = float(_typed(body, name, _NUMBER, "a number", default))
    except OverflowError:
        raise bad_request(f"'{name}' is out of range", param=name) from None
    if not lo <= value <= hi:
        raise bad_request(f"'{name}' must be in [{lo}, {hi}], got {value}", param=name)
    return value


def _max_tokens(body: dict, *names: str) -> int | None:
    for name in names:
        value = _typed(body, name, int, "an integer")
        if value is not None:
            if value < 1:
                raise bad_request(f"'{name}' must be at least 1, got {value}", param=name)
            return value
    return None


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise bad_request("'stop' must be a string or a list of at most 4 strings", param="stop")
    return tuple(s for s in stop if s)


def _common(spec: CallSpec, body: dict) -> CallSpec:
    spec.temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    spec.top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if spec.top_p == 0.0:
        raise bad_request("'top_p' must be greater than 0", param="top_p")
    spec.seed = _typed(body, "seed", int, "an integer")
    if spec.seed is not None and not 0 <= spec.seed < 1 << 63:
        raise bad_request("'seed' must be in [0, 2**63)", param="seed")
    spec.stream = _typed(body, "stream", bool, "a boolean", False)
    opts = _typed(body, "stream_options", dict, "an object", {})
    spec.include_usage = _typed(opts, "include_usage", bool, "a boolean", False)
    spec.return_token_ids = _typed(body, "return_token_ids", bool, "a boolean", False)
    spec.ignore_eos = _typed(body, "ignore_eos", bool, "a boolean", False)
    n = _typed(body, "n", int, "an integer", 1)
    if n != 1:
        raise bad_request("only 'n' = 1 is supported: send one request per sample", param="n")
    return spec


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", param="model")
    return model


def content_text(content: Any, where: str) -> str:
    """A message content (a string, null, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
                continue
            if not isinstance(part, dict):
                raise bad_request(f"{where}.content[{i}] must be an object", param=f"{where}.content")
            kind = part.get("type", "text")
            if kind not in TEXT_PARTS:
                raise bad_request(f"{where}.content[{i}]: content part type {kind!r} is not supported (text only)",
                                  param=f"{where}.content")
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}.content[{i}].text must be a string", param=f"{where}.content")
            out.append(text)
        return "".join(out)
    raise bad_request(f"{where}.content must be a string, null or a list of parts, got {type(content).__name__}",
                      param=f"{where}.content")


def _arguments(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    raise bad_request(f"{where}.arguments must be a JSON string", param=where)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{where}.tool_calls must be a list", param=f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise bad_request(f"{w} must be an object with a 'function'", param=w)
        fn = call["function"]
        if not isinstance(fn.get("name"), str):
            raise bad_request(f"{w}.function.name must be a string", param=w)
        cid = call.get("id")
        if not isinstance(cid, str) or not cid:
            raise bad_request(f"{w}.id must be a non-empty string", param=w)
        out.append({"id": cid, "type": "function",
                    "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments", "{}"), f"{w}.function")}})
    return out


def chat_messages(messages: Any) -> list[dict]:
    """Validate chat messages and normalize them (``developer`` becomes ``system``; content parts
    are joined into one string)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", param="messages")
        role = m.get("role")
        role = "system" if role == "developer" else role
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of system, developer, user, assistant, tool; got {role!r}",
                              param=f"{where}.role")
        msg = {"role": role, "content": content_text(m.get("content"), where)}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str):
                raise bad_request(f"{where}.tool_call_id must be a string", param=f"{where}.tool_call_id")
            msg["tool_call_id"] = cid
        out.append(msg)
    return out


def function_tool(tool: Any, where: str, flat: bool = False) -> dict:
    """One tool definition, normalized to the chat form; ``flat`` is the Responses API's form
    (``name`` beside ``type`` instead of inside ``function``)."""
    if not isinstance(tool, dict):
        raise bad_request(f"{where} must be an object", param="tools")
    if tool.get("type") != "function":
        raise bad_request(f"{where}.type {tool.get('type')!r} is not supported: only 'function' tools", param="tools")
    fn = tool if flat else tool.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function must be an object", param="tools")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise bad_request(f"{where}: function name must match {TOOL_NAME.pattern}, got {name!r}", param="tools")
    desc = fn.get("description")
    if desc is not None and not isinstance(desc, str):
        raise bad_request(f"{where}: description must be a string", param="tools")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise bad_request(f"{where}: parameters must be a JSON Schema object", param="tools")
        if params.get("type", "object") != "object":
            raise bad_request(f"{where}: parameters must describe an object (type 'object'), got {params.get('type')!r}",
                              param="tools")
        props = params.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise bad_request(f"{where}: parameters.properties must map names to schemas", param="tools")
    out = {"name": name}
    if desc:
        out["description"] = desc
    if params is not None:
        out["parameters"] = params
    return {"type": "function", "function": out}


def _tools(body: dict, flat: bool) -> tuple[list[dict], str | tuple[str, str]]:
    tools = _typed(body, "tools", list, "a list", [])
    norm = [function_tool(t, f"tools[{i}]", flat) for i, t in enumerate(tools)]
    names = [t["function"]["name"] for t in norm]
    if len(set(names)) != len(names):
        raise bad_request("tool names must be unique", param="tools")
    choice = body.get("tool_choice") or ("auto" if norm else "none")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = choice.get("name") if flat or "name" in choice else (fn.get("name") if isinstance(fn, dict) else None)
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("'tool_choice' object must name a function", param="tool_choice")
        if name not in names:
            raise bad_request(f"'tool_choice' names {name!r}, which is not among the tools", param="tool_choice")
        return norm, ("function", name)
    if choice not in ("auto", "none", "required"):
        raise bad_request(f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {choice!r}",
                          param="tool_choice")
    if choice == "required" and not norm:
        raise bad_request("'tool_choice' is 'required' but no tools were given", param="tool_choice")
    return norm, choice


def parse_chat(body: dict) -> CallSpec:
    spec = _common(CallSpec("chat", _model(body)), body)
    spec.messages = chat_messages(body.get("messages"))
    spec.tools, spec.tool_choice = _tools(body, flat=False)
    spec.max_tokens = _max_tokens(body, "max_completion_tokens", "max_tokens")
    spec.stop = _stop(body)
    spec.logprobs = _typed(body, "logprobs", bool, "a boolean", False)
    return spec


def parse_completions(body: dict) -> CallSpec:
    spec = _common(CallSpec("completions", _model(body)), body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        spec.prompt_text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < 1 << 31 for t in prompt):
            raise bad_request("prompt token ids must be non-negative 32-bit integers", param="prompt")
        spec.prompt_ids = list(prompt)
    else:
        raise bad_request("'prompt' must be a non-empty string or list of token ids (one prompt per request)",
                          param="prompt")
    if body.get("echo"):
        raise bad_request("'echo' is not supported", param="echo")
    if body.get("suffix"):
        raise bad_request("'suffix' is not supported", param="suffix")
    spec.max_tokens = _max_tokens(body, "max_tokens")
    spec.stop = _stop(body)
    lp = _typed(body, "logprobs", (int, bool), "an integer", None)
    spec.logprobs = lp is not None and lp is not False
    return spec


def _response_items(items: list, where: str = "input") -> list[dict]:
    """Responses API input items as chat messages: a ``function_call`` item joins the assistant
    message right before it (text and calls of one turn arrive as separate items), a
    ``function_call_output`` item becomes a tool message."""
    out: list[dict] = []
    joinable = False  # whether the last message is an assistant turn that calls may extend
    for i, item in enumerate(items):
        w = f"{where}[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{w} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = "system" if role == "developer" else role
            if role not in ("system", "user", "assistant"):
                raise bad_request(f"{w}.role must be system, developer, user or assistant; got {role!r}", param=where)
            out.append({"role": role, "content": content_text(item.get("content"), w)})
            joinable = role == "assistant"
        elif kind == "function_call":
            cid, name = item.get("call_id"), item.get("name")
            if not isinstance(cid, str) or not isinstance(name, str):
                raise bad_request(f"{w}: a function_call needs string 'call_id' and 'name'", param=where)
            call = {"id": cid, "type": "function",
                    "function": {"name": name, "arguments": _arguments(item.get("arguments", "{}"), w)}}
            if joinable:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            joinable = True
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str):
                raise bad_request(f"{w}: a function_call_output needs a string 'call_id'", param=where)
            out.append({"role": "tool", "tool_call_id": cid, "content": content_text(item.get("output"), w)})
            joinable = False
        elif kind != "reasoning":
            raise bad_request(f"{w}: input item type {kind!r} is not supported", param=where)
    return out


def parse_responses(body: dict) -> CallSpec:
    spec = _common(CallSpec("responses", _model(body)), body)
    instructions = _typed(body, "instructions", str, "a string")
    items = body.get("input")
    if isinstance(items, str):
        messages = [{"role": "user", "content": items}]
    elif isinstance(items, list) and items:
        messages = _response_items(items)
    else:
        raise bad_request("'input' must be a non-empty string or list of items", param="input")
    spec.messages = messages
    spec.instructions = instructions
    spec.tools, spec.tool_choice = _tools(body, flat=True)
    spec.max_tokens = _max_tokens(body, "max_output_tokens")
    spec.previous_response_id = _typed(body, "previous_response_id", str, "a string")
    return spec


PARSERS = {"chat": parse_chat, "completions": parse_completions, "responses": parse_responses}
