"""One model call, from a validated request to a reply ready to send (and, once sent, to record)."""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from dataclasses import dataclass

import numpy as np

from gyreflow.agents.loop import call_seed
from gyreflow.engine.base import GenerationRequest, SamplingParams
from gyreflow.proxy.errors import ApiError, bad_request
from gyreflow.proxy.render import ChatRenderer
from gyreflow.proxy.requests import CallSpec
from gyreflow.proxy.sessions import Reply, Session
from gyreflow.proxy.toolcalls import ToolCallParser

ROLE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass
class ModelCard:
    """What the proxy serves: the model's name, how to render its prompts and read its tool calls."""

    name: str
    renderer: ChatRenderer
    parser: ToolCallParser
    vocab_size: int

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")


def call_role(header: str | None, session: Session) -> str:
    """Who makes the call (``X-Gyreflow-Role``: a summarizer, a sub-agent...); the session's role
    by default."""
    if not header:
        return session.role
    if not ROLE.match(header):
        raise bad_request(f"X-Gyreflow-Role must match {ROLE.pattern}, got {header[:40]!r}")
    return header


def _messages(spec: CallSpec, session: Session) -> list[dict]:
    if spec.previous_response_id is None:
        return spec.messages
    before = session.conversations.get(spec.previous_response_id)
    if before is None:
        raise bad_request(f"previous response {spec.previous_response_id!r} not found in this session",
                          param="previous_response_id")
    return before + spec.messages


def _prompt(spec: CallSpec, session: Session, card: ModelCard) -> tuple[np.ndarray, str, list[dict] | None]:
    """Prompt ids, the forced prefix, and (for chat-style calls) the full conversation."""
    if spec.endpoint == "completions":
        ids = np.asarray(spec.prompt_ids if spec.prompt_ids is not None else card.renderer.encode(spec.prompt_text),
                         dtype=np.int32)
        if len(ids) and (ids.min() < 0 or ids.max() >= card.vocab_size):
            raise bad_request(f"prompt token ids must be in [0, {card.vocab_size})", param="prompt")
        return ids, "", None
    messages = _messages(spec, session)
    forced = card.parser.forced_prefix(spec.tool_choice) if spec.tools else ""
    ids = card.renderer.render(messages, spec.tools, session.restored_turns(messages), forced)
    return ids, forced, messages


async def serve_call(session: Session, spec: CallSpec, key: str, card: ModelCard, *, retry: bool = False,
                     role: str | None = None) -> Reply:
    """The reply to one request: a retry's earlier reply, or a new engine call.

    Raises
    ------
    ApiError
        The request is refused (budget, bad prompt) or the engine failed.
    """
    earlier = session.existing(key, retry)
    if earlier is not None:
        return await asyncio.shield(earlier.done)
    session.admit()
    prompt, forced, messages = _prompt(spec, session, card)
    if len(prompt) == 0:
        raise bad_request("the prompt is empty", param="prompt")
    index = session.calls_started
    eid = session.execution_id
    seed = spec.seed if spec.seed is not None else call_seed(session.seed, eid, index)
    params = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, max_tokens=session.max_tokens(spec.max_tokens),
                            stop=spec.stop, stop_token_ids=(card.renderer.eos_id,), seed=seed)
    reply = Reply(key, asyncio.get_running_loop().create_future(), call_index=index, role=role or session.role,
                  prompt_ids=prompt, created=int(time.time()), t_start=time.time())
    reply.done.add_done_callback(lambda f: f.cancelled() or f.exception())  # a lone failure is not "never retrieved"
    session.calls_started += 1
    session.inflight += 1
    session.remember(reply)
    try:
        result = await session.generate(GenerationRequest(f"{eid}/{index}", prompt, params, session=eid))
    except BaseException as err:
        # Whatever happened, a retry waiting on this call must hear of it, and may try again.
        session.replies.pop(key, None)
        out = _engine_error(err)
        reply.done.set_exception(out)
        if isinstance(err, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
            raise
        raise out from None
    finally:
        session.inflight -= 1
    reply.t_end = time.time()
    reply.result = result
    session.tokens_generated += len(result.completion_ids)
    _interpret(reply, spec, forced, card)
    if spec.endpoint == "responses":
        reply.response_id = "resp_" + secrets.token_hex(16)
        turn = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            turn["tool_calls"] = reply.tool_calls
        session.conversations[reply.response_id] = messages + [turn]
    reply.done.set_result(reply)
    return reply


def _engine_error(err: BaseException) -> ApiError:
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ValueError):  # the engine's own check of the request, e.g. a prompt too long
        return bad_request(f"the engine refused the request: {err}", code="context_length_exceeded")
    if isinstance(err, (RuntimeError, OSError)):  # no engine, or its worker went away
        return ApiError(503, f"no engine could serve the call: {err}", type="server_error", code="engine_unavailable")
    return ApiError(500, f"the call failed: {type(err).__name__}: {err}", type="server_error")


def _interpret(reply: Reply, spec: CallSpec, forced: str, card: ModelCard) -> None:
    """The completion as the agent sees it: content, tool calls, finish reason."""
    r = reply.result
    completion = np.asarray(r.completion_ids, dtype=np.int32)
    reply.turn_ids = np.concatenate([np.asarray(card.renderer.encode(forced), dtype=np.int32), completion])
    text = forced + card.renderer.decode(completion)
    stopped_by_string = r.finish_reason == "stop" and not (len(completion) and completion[-1] == card.renderer.eos_id)
    if stopped_by_string:
        for s in spec.stop:
            if text.endswith(s):
                text = text[: -len(s)]  # OpenAI leaves the stop sequence out of the text
                break
    calls = []
    if spec.tools and spec.tool_choice != "none":
        text, parsed = card.parser.parse(text, {t["function"]["name"] for t in spec.tools})
        calls = [{"id": "call_" + secrets.token_hex(12), "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for c in parsed]
    reply.content = text
    reply.tool_calls = calls
    reply.finish_reason = "tool_calls" if calls else ("length" if r.finish_reason == "length" else "stop")
    reply.created = reply.created or int(time.time())


def model_card(tokenizer, name: str = "gyreflow-policy", parser: str = "hermes", vocab_size: int | None = None) -> ModelCard:
    """The card of a model served with ``tokenizer``'s chat template and the named tool-call parser."""
    from gyreflow.proxy.toolcalls import TOOL_PARSERS

    if parser not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; known: {sorted(TOOL_PARSERS)}")
    return ModelCard(name, ChatRenderer(tokenizer), TOOL_PARSERS[parser], int(vocab_size or len(tokenizer)))
