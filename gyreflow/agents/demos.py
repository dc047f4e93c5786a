"""Synthetic demonstrations for the SFT warm start.

A scripted, deliberately imperfect demonstrator plays the vault through the same agent loop that
the policy uses, so demonstrations have exactly the policy's prompt format. Its mistakes (skipping
the note, misreading "highest"/"lowest", malformed calls) leave the SFT policy well above zero but
far from perfect, which is the room reinforcement learning has to improve.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gyreflow.agents.loop import AgentConfig, run_agent
from gyreflow.agents.tasks import DOOR_NAMES, Task, VaultEnv
from gyreflow.engine.base import GenerationRequest, GenerationResult
from gyreflow.model.chat import END_ID, decode_ids, encode_text
from gyreflow.trajectory.records import ExecutionResult


@dataclass(frozen=True)
class DemoNoise:
    """How often the demonstrator errs."""

    p_skip_read: float = 0.15
    """Guess a door without reading the note."""
    p_right_explicit: float = 0.85
    """Pick the named door when the note names one."""
    p_right_compare: float = 0.5
    """Pick the right door when the note says highest/lowest (else the first or a random door)."""
    p_malformed: float = 0.03
    """Emit a call without parentheses."""


class Demonstrator:
    """A scripted policy with the :data:`Generate` signature; it reads the task, not the prompt."""

    def __init__(self, task: Task, noise: DemoNoise, rng: np.random.Generator):
        self.task, self.noise, self.rng = task, noise, rng
        self.shadow = VaultEnv(task)  # mirrors the real env by replaying the same tool calls
        self.read_room = -1

    def _choose(self) -> str:
        room = self.task.rooms[self.shadow.room]
        if self.read_room != self.shadow.room:
            if self.rng.random() < self.noise.p_skip_read:
                return f"go({self.rng.choice(DOOR_NAMES)})"
            self.read_room = self.shadow.room
            return "read()"
        explicit = room.note in DOOR_NAMES
        p = self.noise.p_right_explicit if explicit else self.noise.p_right_compare
        if self.rng.random() < p:
            door = room.answer
        elif explicit:
            door = str(self.rng.choice([d for d in DOOR_NAMES if d != room.answer]))
        else:
            door = str(self.rng.choice(DOOR_NAMES))
        if self.rng.random() < self.noise.p_malformed:
            return f"go {door}"
        return f"go({door})"

    def __call__(self, request: GenerationRequest) -> GenerationResult:
        text = self._choose()
        self.shadow.execute(text)
        ids = np.asarray(encode_text(text) + [END_ID], dtype=np.int32)
        assert decode_ids(ids) == text
        return GenerationResult(
            request_id=request.request_id,
            prompt_ids=np.asarray(request.prompt_ids, dtype=np.int32),
            completion_ids=ids,
            logprobs=np.zeros(len(ids), np.float32),
            versions=np.full(len(ids), -1, np.int32),
            finish_reason="stop",
            engine="demonstrator",
        )


def demonstrations(tasks: list[Task], cfg: AgentConfig, noise: DemoNoise, seed: int = 0) -> list[ExecutionResult]:
    """One demonstration execution per task."""
    rng = np.random.default_rng(seed)
    return [
        run_agent(task, Demonstrator(task, noise, rng), cfg, f"demo-{task.task_id}", seed=seed, role="demo")
        for task in tasks
    ]
