"""External executions: an unmodified agent program, run as a subprocess against the proxy.

The program gets its session's base URL and key through the usual environment variables, a fresh
copy of the task's workspace as its working directory, and time and resource limits. Whatever way
it ends (done, crash, hang, budget spent), the workspace is graded as it stands, and its model
calls, recorded by the proxy, are the execution's trajectory.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from gyreflow.agents.process import ProcessLimits, agent_environment, run_process
from gyreflow.agents.suite import SuiteTask, grade_workspace, prepare_workspace
from gyreflow.proxy.sessions import Budget, Generate, SamplingPin, Session
from gyreflow.trajectory.records import ExecutionResult


OFFLINE_ENV = {
    # Harnesses that phone home at start-up (price lists, traces, telemetry) must not hang an
    # offline execution; these are the switches common ones read. ``ExternalAgent.env`` wins.
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",
    "DO_NOT_TRACK": "1",
    "ANONYMIZED_TELEMETRY": "False",
    "HF_HUB_OFFLINE": "1",
    "NO_PROXY": "127.0.0.1,localhost",
}


@dataclass(frozen=True)
class ExternalAgent:
    """How to run an agent program for an execution.

    ``command`` is an argv; ``{python}`` in it becomes this Python interpreter, ``{prompt}`` the
    task's prompt and ``{workspace}`` the working directory. The prompt is also in ``TASK.md``.
    """

    command: tuple[str, ...] = ("{python}", "examples/openai_agent/agent.py")
    time_limit_s: float = 300.0
    """Wall-clock limit of the program (a task's own ``time_limit_s`` wins)."""
    memory_mb: int | None = 4096
    """Address-space limit of the program."""
    max_calls: int = 32
    """Model calls one execution may make."""
    token_budget: int = 8192
    """Tokens one execution may generate."""
    max_tokens_per_call: int = 256
    """Completion length of a call that names none (and the most one may name)."""
    max_inflight: int = 4
    """Calls of one execution running at once."""
    pin_temperature: float | None = None
    """Sample every call at this temperature whatever the program asks (``None``: as it asks; a
    greedy call is then context for training, not a sample)."""
    pin_top_p: float | None = None
    """Likewise for top-p (``None``: as asked; a call with ``top_p < 1`` is then context)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of the program."""
    demo_write_tool: str = "write_file"
    """The program's tool that writes a file (``path``, ``content``): the SFT demonstrator writes
    each file of a task's solution with it."""
    demo_finish_tool: str = "finish"
    """The program's tool that ends the task: the demonstrator's last call."""

    def __post_init__(self) -> None:
        if isinstance(self.command, str) or not self.command or not all(isinstance(a, str) and a for a in self.command):
            raise ValueError("ExternalAgent.command must be a non-empty list of strings")
        object.__setattr__(self, "command", tuple(self.command))
        if not isinstance(self.env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ValueError("ExternalAgent.env must map names to strings")
        if self.time_limit_s <= 0:
            raise ValueError(f"ExternalAgent.time_limit_s must be positive, got {self.time_limit_s}")
        try:
            SamplingPin(self.pin_temperature, self.pin_top_p)
        except ValueError as err:
            raise ValueError(str(err).replace("SamplingPin.", "ExternalAgent.pin_")) from None

    def argv(self, task: SuiteTask, workdir: Path) -> list[str]:
        subs = {"{python}": sys.executable, "{prompt}": task.prompt, "{workspace}": str(workdir)}
        out = []
        for arg in self.command:
            for k, v in subs.items():
                arg = arg.replace(k, v)
            out.append(arg)
        # A relative script path means the project's, wherever the worker's working directory is.
        if len(out) > 1 and not Path(out[1]).is_absolute() and Path(out[1]).exists():
            out[1] = str(Path(out[1]).resolve())
        return out

    def limits(self, task: SuiteTask) -> ProcessLimits:
        return ProcessLimits(time_limit_s=float(task.time_limit_s or self.time_limit_s), memory_mb=self.memory_mb)

    def budget(self, task: SuiteTask) -> Budget:
        # The session outlives the program by a margin so that its last call is not cut by the clock.
        return Budget(max_calls=self.max_calls, token_budget=self.token_budget,
                      time_limit_s=self.limits(task).time_limit_s + 30.0,
                      max_tokens_per_call=self.max_tokens_per_call, max_inflight=self.max_inflight)


class SessionHost(Protocol):
    """Where sessions are opened: the proxy of this worker, or one on its own thread."""

    def open(self, execution_id: str, generate: Generate, *, budget: Budget | None = None, seed: int = 0,
             role: str = "", pin: SamplingPin | None = None) -> Session: ...

    def close(self, execution_id: str) -> Session: ...

    def environment(self, session: Session) -> dict[str, str]: ...


def _end_reason(returncode: int | None, timed_out: bool, session: Session) -> str:
    if session.engine_failures and returncode != 0:
        return "infra_failure"  # the program died of the engine failing it, not of its own doing
    if timed_out:
        return "time_limit"
    if session.refused.get("budget"):
        spent = (session.calls_charged >= session.budget.max_calls
                 or session.tokens_generated >= session.budget.token_budget)
        return "budget" if spent else "time_limit"
    return "done" if returncode == 0 else "policy_crash"


def run_external(task: SuiteTask, agent: ExternalAgent, host: SessionHost, generate: Generate, execution_id: str,
                 *, step: int = 0, sample: int = 0, seed: int = 0, workdir_root: str | None = None,
                 keep_workdir: bool = False) -> ExecutionResult:
    """Run one external execution of ``task``; never raises for the program's failures.

    Parameters
    ----------
    task
        The task: prompt, workspace, tests.
    agent
        The program and its limits.
    host
        Opens the execution's proxy session.
    generate
        How the session's calls reach an engine (the router inside Dask).
    """
    root = Path(workdir_root or tempfile.gettempdir()) / "gyreflow-workspaces"
    root.mkdir(parents=True, exist_ok=True)
    session = host.open(execution_id, generate, budget=agent.budget(task), seed=seed,
                        pin=SamplingPin(agent.pin_temperature, agent.pin_top_p))
    try:
        workdir = prepare_workspace(task, root)
    except BaseException:
        host.close(execution_id)
        raise
    (workdir / "TASK.md").write_text(task.prompt)
    try:
        env = agent_environment({**OFFLINE_ENV, **host.environment(session), **agent.env,
                                 "GYREFLOW_TASK_ID": task.task_id})
        outcome = run_process(agent.argv(task, workdir), workdir, env, agent.limits(task))
    finally:
        session = host.close(execution_id)
    try:
        grade = grade_workspace(task, workdir)
    except Exception as err:
        grade = None
        grade_error = f"{type(err).__name__}: {err}"
    finally:
        if not keep_workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    if grade is None:
        return ExecutionResult(execution_id=execution_id, task_id=task.task_id, step=step, sample=sample,
                               split=task.split, calls=list(session.records), reward=0.0, passed=False,
                               end_reason="grader_failure", metrics={"error": grade_error,
                                                                     "returncode": outcome.returncode})
    metrics = {
        "returncode": outcome.returncode, "timed_out": outcome.timed_out, "wall_s": outcome.wall_s,
        "killed_processes": outcome.killed, "tests": [{k: r[k] for k in ("command", "returncode") if k in r}
                                                      for r in grade.results],
        "calls_refused": dict(session.refused), "tokens_generated": session.tokens_generated,
        "stderr_tail": outcome.stderr_tail[-1000:],
    }
    if outcome.error:
        metrics["error"] = outcome.error
    return ExecutionResult(execution_id=execution_id, task_id=task.task_id, step=step, sample=sample,
                           split=task.split, calls=list(session.records), reward=float(grade.score),
                           passed=bool(grade.passed),
                           end_reason=_end_reason(outcome.returncode, outcome.timed_out, session), metrics=metrics)
