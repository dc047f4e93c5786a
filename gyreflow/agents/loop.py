"""The native agent loop: model call -> tool-call parsing -> tool result -> ... until the task ends.

Prompts are built in token space: each new prompt is the previous prompt, the ids the engine
sampled, and the tool's reply, so recorded tokens are exactly what the engine consumed and produced.
When the context outgrows ``max_context_tokens`` the loop compacts it (keeps the task and the most
recent turns that fit), which makes the execution's trajectory tree branch.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Callable

from gyreflow.agents.tasks import Task, VaultEnv
from gyreflow.engine.base import GenerationRequest, GenerationResult, SamplingParams
from gyreflow.model.chat import END_ID, decode_ids, generation_prompt_ids, message_ids
from gyreflow.trajectory.records import CallRecord, ExecutionResult

Generate = Callable[[GenerationRequest], GenerationResult]


@dataclass(frozen=True)
class AgentConfig:
    """How the native agent samples and when an execution is cut off."""

    temperature: float = 1.0
    """Sampling temperature of every model call (behaviour log-probs are taken at it)."""
    top_p: float = 1.0
    """Nucleus mass of every model call."""
    max_tokens_per_call: int = 24
    """Longest completion of one call."""
    max_context_tokens: int = 2048
    """Compact the context (keep the task and the latest turns) above this many prompt tokens."""
    keep_turns: int = 6
    """Turns kept after a compaction."""
    token_budget: int = 16384
    """Most tokens one execution may generate; then it ends and is graded as it stands."""
    time_limit_s: float = 900.0
    """Wall-clock limit of one execution; then it ends and is graded as it stands."""


def call_seed(seed: int, execution_id: str, index: int) -> int:
    # Stable across processes (unlike hash()), so a rerun samples the same tokens.
    return zlib.crc32(f"{seed}/{execution_id}/{index}".encode()) & 0x7FFFFFFF


def build_prompt(head: list[int], turns: list[list[int]], cfg: AgentConfig) -> tuple[list[int], bool]:
    """The next prompt; returns (ids, compacted).

    A compacted prompt keeps the task and the latest turns that fit in ``max_context_tokens``
    (at most ``keep_turns``, possibly none), so it never outgrows the context it was cut for.
    """
    tail = generation_prompt_ids()
    body = [t for turn in turns for t in turn]
    if len(head) + len(body) + len(tail) <= cfg.max_context_tokens:
        return head + body + tail, False
    room = cfg.max_context_tokens - len(head) - len(tail)
    kept: list[list[int]] = []
    for turn in reversed(turns[-cfg.keep_turns :]):
        if len(turn) > room:
            break
        kept.insert(0, turn)
        room -= len(turn)
    return head + [t for turn in kept for t in turn] + tail, True


def run_agent(
    task: Task,
    generate: Generate,
    cfg: AgentConfig,
    execution_id: str,
    *,
    step: int = 0,
    sample: int = 0,
    seed: int = 0,
    role: str = "main",
) -> ExecutionResult:
    """Run one execution of the native agent on ``task``; never raises for the agent's mistakes.

    A malformed tool call becomes an error observation; an engine failure ends the execution as
    ``infra_failure``; budgets end it as ``budget`` or ``time_limit``. It is graded in every case
    (``grader_failure`` if grading raises).
    """
    env = VaultEnv(task)
    head = message_ids("user", env.prompt())
    turns: list[list[int]] = []
    calls: list[CallRecord] = []
    generated = 0
    compactions = 0
    t0 = time.monotonic()
    end_reason = "done"
    crash: str | None = None  # what the engine raised, if a call failed
    while not env.finished:
        if env.calls >= task.max_calls or generated >= cfg.token_budget:
            end_reason = "budget"
            break
        if time.monotonic() - t0 > cfg.time_limit_s:
            end_reason = "time_limit"
            break
        prompt, compacted = build_prompt(head, turns, cfg)
        compactions += compacted
        index = len(calls)
        params = SamplingParams(
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=min(cfg.max_tokens_per_call, cfg.token_budget - generated),
            stop_token_ids=(END_ID,),
            seed=call_seed(seed, execution_id, index),
        )
        request = GenerationRequest(f"{execution_id}/{index}", prompt, params, session=execution_id)
        t_call = time.time()
        try:
            out = generate(request)
        except ValueError as err:  # the engine refused the request (context longer than it holds)
            end_reason = "budget"
            crash = f"{type(err).__name__}: {err}"
            break
        except Exception as err:  # the engine or the route failed: the system's fault, not the policy's
            end_reason = "infra_failure"
            crash = f"{type(err).__name__}: {err}"
            break
        calls.append(
            CallRecord(
                execution_id=execution_id,
                call_index=index,
                call_id=request.request_id,
                role=role,
                prompt_ids=out.prompt_ids,
                completion_ids=out.completion_ids,
                logprobs=out.logprobs,
                versions=out.versions,
                finish_reason=out.finish_reason,
                engine=out.engine,
                t_start=t_call,
                t_end=time.time(),
                temperature=params.temperature,
                top_p=params.top_p,
            )
        )
        completion = [int(t) for t in out.completion_ids]
        generated += len(completion)
        text = decode_ids(completion)
        observation = env.execute(text)
        # A completion cut at max_tokens lacks <|end|>; close it so the next prompt stays well formed.
        closed = completion if completion and completion[-1] == END_ID else completion + [END_ID]
        turns.append(generation_prompt_ids() + closed + message_ids("tool", observation))
    metrics = {"compactions": compactions, "tokens_generated": generated}
    if crash is not None:
        metrics["error"] = crash
    try:
        reward, passed = env.grade()
        metrics |= env.metrics()
    except Exception as err:
        reward, passed, end_reason = 0.0, False, "grader_failure"
        metrics["error"] = f"{type(err).__name__}: {err}"
    return ExecutionResult(
        execution_id=execution_id,
        task_id=task.task_id,
        step=step,
        sample=sample,
        split=task.split,
        calls=calls,
        reward=float(reward),
        passed=bool(passed),
        end_reason=end_reason,
        metrics=metrics,
    )
