"""Demonstrations for suite tasks, recorded through the agent program itself.

The SFT warm start needs trajectories in exactly the format the policy will see: the program's
own system prompt, tools and history handling, rendered by the proxy. So the program runs as in
an external execution, against a proxy whose "engine" is a demonstrator: it answers each call with
the next step of the task's reference solution (write each solution file, then finish), as tool
calls in the model's syntax. The proxy records those calls like any other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from gyreflow.agents.external import ExternalAgent, run_external
from gyreflow.agents.suite import SuiteTask
from gyreflow.engine.base import GenerationRequest, GenerationResult
from gyreflow.proxy.calls import ModelCard
from gyreflow.proxy.local import ProxyThread
from gyreflow.trajectory.records import ExecutionResult


@dataclass(frozen=True)
class DemoTools:
    """The program's tools the demonstrator uses."""

    write: str = "write_file"
    """Writes a file; called with ``path`` and ``content``."""
    finish: str = "finish"
    """Ends the task; called with no arguments."""


class Demonstrator:
    """``generate`` for one demonstration session: the solution, one tool call per model call."""

    def __init__(self, task: SuiteTask, card: ModelCard, tools: DemoTools) -> None:
        self.steps = [(tools.write, {"path": p, "content": c}) for p, c in task.solution] + [(tools.finish, {})]
        self.card = card
        self.calls = 0

    async def __call__(self, request: GenerationRequest) -> GenerationResult:
        name, args = self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        text = "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"
        # When the program demands a tool call, the proxy has already put its opening in the
        # prompt: continue from there.
        tail = self.card.renderer.decode(np.asarray(request.prompt_ids)[-64:])
        text = text[next((k for k in range(min(len(tail), len(text)), 0, -1) if tail.endswith(text[:k])), 0):]
        ids = self.card.renderer.encode(text) + [self.card.renderer.eos_id]
        # Cut like an engine would: a call that does not fit its max_tokens ends with "length".
        finish = "stop" if len(ids) <= request.params.max_tokens else "length"
        ids = ids[: request.params.max_tokens]
        n = len(ids)
        return GenerationResult(request.request_id, np.asarray(request.prompt_ids, dtype=np.int32),
                                np.asarray(ids, dtype=np.int32), np.zeros(n, np.float32), np.zeros(n, np.int32),
                                finish, engine="demonstrator")


def suite_demonstrations(tasks: list[SuiteTask], agent: ExternalAgent, card: ModelCard,
                         tools: DemoTools = DemoTools(), repeats: int = 1) -> list[ExecutionResult]:
    """Run the agent program on each task with a solution (``repeats`` times), the demonstrator
    answering its calls; the executions that solved their task.

    Raises
    ------
    ValueError
        No task has a solution, or no demonstration solved its task (the program does not offer
        the tools in ``tools``, or the suite's solutions are wrong).
    """
    solvable = [t for t in tasks if t.solution]
    if not solvable:
        raise ValueError("no task of the suite has a 'solution' to demonstrate")
    out, failed = [], []
    with ProxyThread(card) as proxy:
        for r in range(repeats):
            for task in solvable:
                eid = f"demo-{task.task_id}-{r}"
                result = run_external(task, agent, proxy, Demonstrator(task, card, tools), eid)
                (out if result.passed else failed).append(result)
    if not out:
        f = failed[0]
        raise ValueError(f"no demonstration solved its task; does the agent program offer the tools "
                         f"{tools.write!r} and {tools.finish!r}, and allow a call enough tokens to write a "
                         f"solution file? (demonstration {f.execution_id}: {f.end_reason}, score {f.reward:.2f}, "
                         f"stderr: {f.metrics.get('stderr_tail', '')[-200:]!r})")
    return out
