"""The pools' books: counters, moves, role timeline and samples, and the one status object that the
``gyreflow_pools`` RPC, the dashboard page, ``/metrics`` and run reports all read."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field

from gyreflow.cluster.pools import ROLLOUT, TRAINER


@dataclass(frozen=True)
class PoolsStatus:
    """The pools as of ``time`` (plugin clock seconds; ``wall`` in seconds since the epoch)."""

    time: float
    wall: float
    mode: str
    pools: dict[str, list[str]]
    """``rollout`` / ``trainer`` -> cell addresses."""
    moving: list[str]
    """Cells whose move is being applied."""
    sessions: dict[str, int]
    """Rollout cell -> live executions routed to it."""
    train_tasks: dict[str, int]
    """Cell -> trainer tasks running on or queued for it."""
    train_waiting: int
    """Trainer tasks ready that no cell holds."""
    route_waiting: int
    """Model calls waiting for any rollout engine."""
    routed: int
    moves: int
    moves_failed: int
    migrations: int
    rebalanced_sessions: int
    migrated_bytes: int
    idle_cell_seconds: float
    """Cell-seconds (plugin clock) with nothing to do: a rollout cell without executions, a trainer
    cell without trainer tasks."""
    move_log: list[dict]
    """The latest moves: cell, to, reason, decided/applied (clock), outcome."""
    timeline: list[dict]
    """Every change of the pools: ``{"time", "wall", "rollout", "trainer"}`` (cell counts)."""
    stalls: list[dict]
    """Executions without progress for longer than the stall limit: execution, seconds, waits_on."""
    history: list[dict] = field(default_factory=list)
    """Samples for the dashboard: time, cells per role, executions per cell, queued training."""

    def to_dict(self) -> dict:
        return asdict(self)


class Books:
    """What the plugin records as it runs (the mutable side of :class:`PoolsStatus`).

    Parameters
    ----------
    history_len
        Samples, moves and timeline entries kept.
    """

    def __init__(self, history_len: int = 4000) -> None:
        self.routed = 0
        self.moves = 0
        self.moves_failed = 0
        self.migrations = 0
        self.rebalanced_sessions = 0
        self.migrated_bytes = 0
        self.idle_cell_seconds = 0.0
        self.move_log: deque[dict] = deque(maxlen=history_len)
        self.timeline: deque[dict] = deque(maxlen=history_len)
        self.history: deque[dict] = deque(maxlen=history_len)
        self._last_account: float | None = None
        self._last_sample = float("-inf")

    def migrated(self, count: int, nbytes: int) -> None:
        self.migrations += count
        self.migrated_bytes += nbytes

    def move(self, entry: dict) -> None:
        """A move was applied (or failed, or was aborted: ``entry`` says which)."""
        if entry.get("error") or entry.get("aborted"):
            self.moves_failed += 1
        else:
            self.moves += 1
        self.move_log.append(entry)

    def roles_changed(self, time: float, wall: float, roles: dict[str, str]) -> None:
        """Note the cell counts if they differ from the last entry of the timeline."""
        n = {ROLLOUT: sum(r == ROLLOUT for r in roles.values()), TRAINER: sum(r == TRAINER for r in roles.values())}
        if self.timeline and all(self.timeline[-1][k] == v for k, v in n.items()):
            return
        self.timeline.append({"time": time, "wall": wall, **n})

    def account(self, time: float, idle_cells: int, sample: dict, every: float) -> None:
        """Idle cell-seconds since the last call; a history sample at most every ``every`` s."""
        if self._last_account is not None:
            self.idle_cell_seconds += idle_cells * max(0.0, time - self._last_account)
        self._last_account = time
        if time - self._last_sample >= every:
            self._last_sample = time
            self.history.append({"time": time, **sample, "moves": self.moves, "migrations": self.migrations})

    def counters(self) -> dict:
        return {"routed": self.routed, "moves": self.moves, "moves_failed": self.moves_failed,
                "migrations": self.migrations, "rebalanced_sessions": self.rebalanced_sessions,
                "migrated_bytes": self.migrated_bytes, "idle_cell_seconds": self.idle_cell_seconds}


def between(before: dict, after: dict) -> dict:
    """What the pools did between two status dicts (``gyreflow_pools`` replies): moves, failed moves,
    migrations, and the cells each role had (the counts at the start, then every change; ``time``
    in wall seconds after the start)."""
    t0 = before["wall"]
    start = {"time": 0.0, ROLLOUT: len(before["pools"][ROLLOUT]), TRAINER: len(before["pools"][TRAINER])}
    changes = [{"time": e["wall"] - t0, ROLLOUT: e[ROLLOUT], TRAINER: e[TRAINER]}
               for e in after["timeline"] if t0 < e["wall"] <= after["wall"]]
    return {"moves": after["moves"] - before["moves"], "moves_failed": after["moves_failed"] - before["moves_failed"],
            "migrations": after["migrations"] - before["migrations"], "cells": [start, *changes],
            "stalls": after["stalls"]}


def describe(placement: dict) -> str:
    """One line for a run's log: ``cells 2/1 -> 1/2 -> 2/1, 2 moves, 5 migrations``."""
    cells = " -> ".join(f"{c[ROLLOUT]}/{c[TRAINER]}" for c in placement["cells"])
    out = f"cells (rollout/trainer) {cells}, {placement['moves']} moves, {placement['migrations']} migrations"
    if placement["moves_failed"]:
        out += f", {placement['moves_failed']} failed moves"
    if placement["stalls"]:
        out += f", {len(placement['stalls'])} stalled executions"
    return out
