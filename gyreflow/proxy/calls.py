"""One model call, from a validated request to a reply ready to send (and, once sent, to record)."""

from __future__ import annotations

import asyncio
import copy
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from gyreflow.agents.loop import call_seed
from gyreflow.engine.base import GenerationRequest, SamplingParams
from gyreflow.proxy.errors import ApiError, bad_request
from gyreflow.proxy.render import ChatRenderer
from gyreflow.proxy.requests import CallSpec
from gyreflow.proxy.sessions import Reply, SamplingPin, Session
from gyreflow.proxy.toolcalls import ToolCallParser

ROLE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


@dataclass
class ModelCard:
    """What the proxy serves: the model's name, how to render its prompts and read its tool calls."""

    name: str
    renderer: ChatRenderer
    parser: ToolCallParser
    vocab_size: int
    _big: ChatRenderer | None = field(default=None, repr=False)

    def big_renderer(self) -> ChatRenderer:
        """A renderer of its own (tokenizer copy, no shared cache) for prompts rendered off the loop."""
        if self._big is None:
            self._big = ChatRenderer(copy.deepcopy(self.renderer.tokenizer), cache_tokens=0)
        return self._big

    def check_model(self, model: str) -> None:
        if model != self.name:
            raise ApiError(404, f"The model {model!r} does not exist; this server serves {self.name!r}",
                           param="model", code="model_not_found")


def call_role(header: str | None, session: Session) -> str:
    """Who makes the call (``X-Gyreflow-Role``: ``main``, ``main-summary``, ``sub-agent``...); the
    session's role by default, which is empty unless set: the tree then infers it
    (:mod:`gyreflow.trajectory.roles`)."""
    if not header:
        return session.role
    if not ROLE.match(header):
        raise bad_request(f"X-Gyreflow-Role must match {ROLE.pattern}, got {header[:40]!r}")
    return header


def _history(spec: CallSpec, session: Session) -> list[dict]:
    """The conversation so far: the stored one of ``previous_response_id``, then the new input."""
    if spec.previous_response_id is None:
        return spec.messages
    before = session.conversations.get(spec.previous_response_id)
    if before is None:
        raise bad_request(f"previous response {spec.previous_response_id!r} not found in this session",
                          param="previous_response_id")
    return before + spec.messages


BIG_PROMPT_CHARS = 200_000
"""Conversations longer than this are rendered off the event loop, which serves every session."""

_big_renders = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyreflow-render")


@dataclass
class Prepared:
    """A call's prompt, ready for the engine: checked before any byte of the reply is sent."""

    prompt: np.ndarray
    forced: str
    history: list[dict] | None
    """Chat-style calls: the conversation without this call's instructions."""


async def prepare_call(session: Session, spec: CallSpec, card: ModelCard) -> Prepared:
    """Admit the call and render its prompt.

    Raises
    ------
    ApiError
        The budget refuses the call, or its prompt is invalid.
    """
    session.admit()
    if spec.endpoint == "completions":
        ids = (np.asarray(spec.prompt_ids, dtype=np.int64) if spec.prompt_ids is not None
               else np.asarray(card.renderer.encode(spec.prompt_text), dtype=np.int64))
        if len(ids) and (ids.min() < 0 or ids.max() >= card.vocab_size):
            raise bad_request(f"prompt token ids must be in [0, {card.vocab_size})", param="prompt")
        return Prepared(ids.astype(np.int32), "", None)
    history = _history(spec, session)
    messages = ([{"role": "system", "content": spec.instructions}] if spec.instructions else []) + history
    forced = card.parser.forced_prefix(spec.tool_choice) if spec.tools else ""
    restored = session.restored_turns(messages)
    if sum(len(m["content"]) for m in messages) > BIG_PROMPT_CHARS:
        # One thread and its own renderer: the tokenizer and the turn cache are not shared.
        renderer = card.big_renderer()
        ids = await asyncio.get_running_loop().run_in_executor(
            _big_renders, renderer.render, messages, spec.tools, restored, forced)
    else:
        ids = card.renderer.render(messages, spec.tools, restored, forced)
    if len(ids) == 0:
        raise bad_request("the prompt is empty", param="prompt")
    return Prepared(ids, forced, history)


def sampling_params(spec: CallSpec, max_tokens: int, eos_id: int, seed: int, execution_id: str,
                    index: int, pin: SamplingPin | None = None, constraint: str | None = None) -> SamplingParams:
    """How call ``index`` of an execution samples: as the client asks, unless the session pins the
    settings (``pin``). A seed the client pins (harness configs often do) is mixed with the execution's,
    so the executions of a group still sample differently."""
    where = execution_id if spec.seed is None else f"{execution_id}#{spec.seed}"
    temperature, top_p = (pin or SamplingPin()).apply(spec.temperature, spec.top_p)
    return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=spec.stop,
                          stop_token_ids=() if spec.ignore_eos else (eos_id,), seed=call_seed(seed, where, index),
                          constraint=constraint)


async def serve_call(session: Session, spec: CallSpec, key: str, card: ModelCard, *, retry: bool = False,
                     role: str | None = None, prepared: Prepared | None = None, started=None,
                     on_token=None) -> Reply:
    """The reply to one request: a retry's earlier reply, or a new engine call.

    ``started(reply)`` is called once a new call's reply exists (its id known) and ``on_token``
    goes to the engine with the request (see :class:`~gyreflow.proxy.streaming.TokenStream`).

    Raises
    ------
    ApiError
        The request is refused (budget, bad prompt) or the engine failed.
    """
    earlier = session.existing(key, retry)
    if earlier is not None:
        return await asyncio.shield(earlier.done)
    if prepared is None:
        prepared = await prepare_call(session, spec, card)
    index = session.calls_started
    eid = session.execution_id
    max_tokens = session.max_tokens(spec.max_tokens)
    # A forced tool call (tool_choice "required" or a named function) is decoded under a
    # template of the parser's call format, so the reply always holds a call of an allowed tool.
    constraint = (card.parser.constraint(spec.tool_choice, [t["function"]["name"] for t in spec.tools],
                                         card.renderer.eos_id) if spec.tools else None)
    params = sampling_params(spec, max_tokens, card.renderer.eos_id, session.seed, eid, index, session.pin,
                             constraint)
    reply = Reply(key, asyncio.get_running_loop().create_future(), call_index=index, request_id=f"{eid}/{index}",
                  role=role or session.role, prompt_ids=prepared.prompt, created=int(time.time()), t_start=time.time(),
                  temperature=params.temperature, top_p=params.top_p)
    if started is not None:
        started(reply)
    reply.done.add_done_callback(lambda f: f.cancelled() or f.exception())  # a lone failure is not "never retrieved"
    session.calls_started += 1
    session.calls_charged += 1
    session.inflight += 1
    session.tokens_reserved += max_tokens
    session.remember(reply)
    try:
        result = await session.generate(GenerationRequest(reply.request_id, prepared.prompt, params, session=eid,
                                                          on_token=on_token))
    except BaseException as err:
        # Whatever happened, a retry waiting on this call must hear of it, and may try again.
        session.replies.pop(key, None)
        out = _engine_error(err)
        if out.status >= 500:
            session.engine_failures += 1
        if out.status == 400:
            session.calls_charged -= 1  # the engine refused it outright: nothing was generated
        reply.done.set_exception(out)
        if isinstance(err, (asyncio.CancelledError, KeyboardInterrupt, SystemExit)):
            raise
        raise out from None
    finally:
        session.inflight -= 1
        session.tokens_reserved -= max_tokens
    reply.t_end = time.time()
    reply.result = result
    session.tokens_generated += len(result.completion_ids)
    _interpret(reply, spec, prepared.forced, card)
    if spec.endpoint == "responses":
        reply.response_id = "resp_" + secrets.token_hex(16)
        turn = {"role": "assistant", "content": reply.content}
        if reply.tool_calls:
            turn["tool_calls"] = reply.tool_calls
        session.conversations[reply.response_id] = prepared.history + [turn]
    reply.done.set_result(reply)
    return reply


def _engine_error(err: BaseException) -> ApiError:
    if isinstance(err, ApiError):
        return err
    if isinstance(err, ValueError):  # the engine's own check of the request
        too_long = "the engine's context" in str(err)
        return bad_request(f"the engine refused the request: {err}",
                           code="context_length_exceeded" if too_long else None)
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
