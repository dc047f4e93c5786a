"""A procedurally generated long-horizon tool-use task suite: the vault.

The agent must cross ``horizon`` rooms. Each room has three doors ``a``, ``b``, ``c``, each with a
number, and a note that says which door opens: a door's name, or "highest"/"lowest" (the door with
the highest or lowest number). Tools:

- ``read()``: returns the room's note;
- ``go(X)``: opens door ``X``; the right door leads to the next room, a wrong one is locked.

Every room costs at least two tool calls, so ``horizon`` sets the length: 5 rooms ~ 10 calls,
100 rooms ~ 200 calls. ``reply_padding`` starts every tool reply with that many characters of
inscription, as real tools return long outputs: 100 rooms with 500 each make contexts of >100K
tokens without compaction. Executions have a call budget, a token budget and a time limit; the grader
gives partial credit for the rooms crossed when the execution ends, however it ends.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import asdict, dataclass, field

import numpy as np

TOOLS_HELP = "tools: read() go(door)"
DOOR_NAMES = ("a", "b", "c")
_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\((.*)\)\s*$", re.S)


@dataclass(frozen=True)
class Room:
    numbers: tuple[int, int, int]
    """The number on door a, b and c."""
    note: str
    """A door's name, ``highest`` or ``lowest``."""
    answer: str
    """The name of the door that opens."""


@dataclass(frozen=True)
class Task:
    task_id: str
    split: str
    rooms: tuple[Room, ...]
    spare_calls: int
    """Calls allowed beyond the two per room that a perfect agent needs."""
    reply_padding: int = 0
    """Characters of inscription every tool reply starts with."""

    @property
    def horizon(self) -> int:
        return len(self.rooms)

    @property
    def kind(self) -> str:
        return "vault"

    @property
    def max_calls(self) -> int:
        return 2 * self.horizon + self.spare_calls

    def to_json(self) -> dict:
        return asdict(self)


def _seed(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def make_task(split: str, index: int, horizon: int, spare_calls: int = 2, p_explicit: float = 0.5,
              reply_padding: int = 0) -> Task:
    """Task ``index`` of ``split``: deterministic in its arguments."""
    # Splits draw from disjoint seed streams, so held-out tasks are never trained on.
    rng = np.random.default_rng(_seed(f"vault/{split}/{index}"))
    rooms = []
    for _ in range(horizon):
        numbers = tuple(int(d) for d in rng.choice(np.arange(10, 100), size=3, replace=False))
        if rng.random() < p_explicit:
            answer = DOOR_NAMES[int(rng.integers(3))]
            note = answer
        elif rng.random() < 0.5:
            answer, note = DOOR_NAMES[int(np.argmax(numbers))], "highest"
        else:
            answer, note = DOOR_NAMES[int(np.argmin(numbers))], "lowest"
        rooms.append(Room(numbers=numbers, note=note, answer=answer))
    return Task(task_id=f"{split}-{index:05d}", split=split, rooms=tuple(rooms), spare_calls=spare_calls,
                reply_padding=reply_padding)


def make_tasks(split: str, n: int, horizon: int, spare_calls: int = 2, start: int = 0,
               reply_padding: int = 0) -> list[Task]:
    return [make_task(split, start + i, horizon, spare_calls, reply_padding=reply_padding) for i in range(n)]


_WORDS = ("the", "stone", "reads", "old", "dust", "of", "kings", "under", "moss", "and", "faded", "ink", "lies",
          "here", "no", "key", "cold", "wind", "through", "cracks")


def inscription(task_id: str, call: int, length: int) -> str:
    """``length`` characters of filler text, the same for a task's call every time."""
    if length <= 0:
        return ""
    rng = np.random.default_rng(_seed(f"{task_id}/{call}"))
    words = [_WORDS[i] for i in rng.integers(len(_WORDS), size=length // 3 + 1)]
    return " ".join(words)[:length]


def parse_tool_call(text: str) -> tuple[str, str]:
    """``"go(47)"`` -> ``("go", "47")``; raises ValueError naming what is malformed."""
    m = _CALL.match(text)
    if not m:
        raise ValueError(f"malformed tool call {text.strip()[:40]!r}; expected name(args). {TOOLS_HELP}")
    return m.group(1), m.group(2).strip()


@dataclass
class VaultEnv:
    """The environment of one execution: executes tools and grades what exists at the end."""

    task: Task
    room: int = 0
    calls: int = 0
    malformed: int = 0
    wrong_doors: int = 0
    log: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.room >= self.task.horizon:
            return "exit reached"
        doors = " ".join(f"{n}={d}" for n, d in zip(DOOR_NAMES, self.task.rooms[self.room].numbers))
        return f"room {self.room + 1}/{self.task.horizon}: {doors}"

    def prompt(self) -> str:
        """The task as the agent first sees it."""
        return f"cross {self.task.horizon} rooms. {TOOLS_HELP}. {self.describe()}"

    @property
    def finished(self) -> bool:
        return self.room >= self.task.horizon

    def execute(self, text: str) -> str:
        """Run the tool call in ``text``; a malformed call yields an error observation."""
        reply = self._execute(text)
        if self.task.reply_padding:
            return f"{inscription(self.task.task_id, self.calls, self.task.reply_padding)}\n{reply}"
        return reply

    def _execute(self, text: str) -> str:
        self.calls += 1
        try:
            name, arg = parse_tool_call(text)
        except ValueError as err:
            self.malformed += 1
            return f"error: {err}"
        room = self.task.rooms[self.room]
        if name == "read":
            return f"note: {room.note}"
        if name == "go":
            if arg not in DOOR_NAMES:
                self.malformed += 1
                return f"error: no door {arg[:12]!r}; doors are a, b, c"
            if arg != room.answer:
                self.wrong_doors += 1
                return "locked"
            self.room += 1
            return self.describe()
        self.malformed += 1
        return f"error: unknown tool {name[:16]!r}. {TOOLS_HELP}"

    def grade(self) -> tuple[float, bool]:
        """Partial credit: the fraction of rooms crossed. Passed only when all are crossed."""
        return self.room / self.task.horizon, self.finished

    def metrics(self) -> dict:
        return {
            "rooms": self.room,
            "horizon": self.task.horizon,
            "tool_calls": self.calls,
            "malformed": self.malformed,
            "wrong_doors": self.wrong_doors,
        }
