"""What an execution leaves behind: one call record per model call, and the execution's outcome.

Every execution ends with one reason of :data:`END_REASONS`:

- ``done``: the agent finished (or its program exited cleanly);
- ``time_limit``, ``budget``: it ran out of time, or of calls or tokens; scored on the work done;
- ``policy_crash``: the agent's own failure (its program crashed); graded and trained like ``done``;
- ``infra_failure``: the system failed it (an engine or route that stopped answering, a worker or
  executor error); ``grader_failure``: grading it failed. These two are the system's fault, not the
  policy's: the execution is re-run within a budget, then dropped as a zero-reward placeholder that
  its group's advantages leave out (:attr:`ExecutionResult.dropped`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class CallRecord:
    """One model call, token-exact.

    ``prompt_ids`` are the ids the engine consumed; ``completion_ids`` the ids it sampled, each with
    its behaviour log-prob and the weights version that produced it.
    """

    execution_id: str
    call_index: int
    call_id: str
    role: str
    """Who made the call: ``policy`` (the agent), ``summarizer``, ``subagent``..."""
    prompt_ids: np.ndarray  # (P,) int32
    completion_ids: np.ndarray  # (C,) int32
    logprobs: np.ndarray  # (C,) float32
    versions: np.ndarray  # (C,) int32
    finish_reason: str = "stop"
    engine: str = ""
    """Address of the engine that served the call."""
    t_start: float = 0.0
    t_end: float = 0.0
    temperature: float = 1.0
    """Temperature the completion was sampled at (0: greedy)."""
    top_p: float = 1.0
    """Nucleus mass it was sampled with."""

    @property
    def trained_as_sample(self) -> bool:
        """Whether the completion is a sample the trainer can score: drawn at a temperature above 0
        from the whole distribution. Behaviour log-probs are those of the untruncated distribution,
        so a greedy or nucleus-truncated completion is context for training, never a sample."""
        return self.temperature > 0 and self.top_p >= 1.0

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int32)
        self.completion_ids = np.asarray(self.completion_ids, dtype=np.int32)
        self.logprobs = np.asarray(self.logprobs, dtype=np.float32)
        self.versions = np.asarray(self.versions, dtype=np.int32)
        n = len(self.completion_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"call {self.call_id}: {n} completion ids but {len(self.logprobs)} log-probs "
                f"and {len(self.versions)} versions"
            )

    def meta(self) -> dict:
        return {
            "execution_id": self.execution_id,
            "call_index": self.call_index,
            "call_id": self.call_id,
            "role": self.role,
            "finish_reason": self.finish_reason,
            "engine": self.engine,
            "t_start": self.t_start,
            "t_end": self.t_end,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }


END_REASONS = ("done", "time_limit", "budget", "policy_crash", "infra_failure", "grader_failure")
RETRIED = frozenset({"infra_failure", "grader_failure"})
"""End reasons that are no verdict on the policy: re-run, then dropped."""
_LEGACY = {"token_budget": "budget", "max_calls": "budget", "crash": "policy_crash", "closed": "done",
           "server_stopped": "done"}


def end_reason(name: str) -> str:
    """``name`` as one of :data:`END_REASONS` (names of earlier releases map to theirs)."""
    name = _LEGACY.get(name, name)
    if name not in END_REASONS:
        raise ValueError(f"unknown end reason {name!r}; allowed: {', '.join(END_REASONS)}")
    return name


def record_problems(result: ExecutionResult, vocab_size: int | None = None,
                    max_positions: int | None = None) -> list[str]:
    """What contradicts itself in an execution's call records (empty when nothing does): ids
    outside the vocabulary, a call longer than the model's positions, a weights version going
    backwards within a call or from one call to the next."""
    problems = []
    last = None
    for c in sorted(result.calls, key=lambda c: c.call_index):
        ids = np.concatenate([c.prompt_ids, c.completion_ids])
        if vocab_size is not None and len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
            problems.append(f"call {c.call_index}: token ids outside the vocabulary [0, {vocab_size})")
        if max_positions is not None and len(ids) > max_positions:
            problems.append(f"call {c.call_index}: {len(ids)} tokens, more than the model's {max_positions} positions")
        v = c.versions
        if len(v) and np.any(np.diff(v) < 0):
            problems.append(f"call {c.call_index}: weights version goes backwards within the call")
        if len(v) and last is not None and int(v[0]) < last:
            problems.append(f"call {c.call_index}: weights version {int(v[0])} after {last} in an earlier call")
        if len(v):
            last = int(v[-1])
    return problems


@dataclass
class ExecutionResult:
    """One execution of an agent at a task: its calls and how it was graded."""

    execution_id: str
    task_id: str
    step: int
    sample: int
    split: str
    """``train`` or ``heldout``."""
    calls: list[CallRecord]
    reward: float
    """Graded score in [0, 1], partial credit included."""
    passed: bool
    end_reason: str
    """One of :data:`END_REASONS`."""
    metrics: dict = field(default_factory=dict)
    worker: str = ""
    """Address of the worker that ran the execution."""

    def __post_init__(self) -> None:
        self.end_reason = end_reason(self.end_reason)

    @property
    def dropped(self) -> bool:
        """A placeholder for an execution the system failed: no verdict on the policy, trains nothing."""
        return self.end_reason in RETRIED

    @property
    def tokens_generated(self) -> int:
        return int(sum(len(c.completion_ids) for c in self.calls))

    def min_version(self) -> int:
        vs = [int(c.versions.min()) for c in self.calls if len(c.versions)]
        return min(vs) if vs else -1

    def meta(self) -> dict:
        return {
            "execution_id": self.execution_id,
            "task_id": self.task_id,
            "step": self.step,
            "sample": self.sample,
            "split": self.split,
            "reward": self.reward,
            "passed": self.passed,
            "end_reason": self.end_reason,
            "metrics": self.metrics,
            "worker": self.worker,
            "n_calls": len(self.calls),
        }
