"""``<run>/report.json``: what a run achieved, rewritten atomically after every committed step."""

from __future__ import annotations

import json
import os
from pathlib import Path


class Report:
    def __init__(self, run_dir: Path, **fields):
        self.path = Path(run_dir) / "report.json"
        self.data: dict = {"initial_heldout_pass_rate": None, "steps": [], **fields}
        self.write()

    @classmethod
    def reopen(cls, run_dir: Path, steps: list[int]) -> "Report":
        """The report of an interrupted run, keeping the entries of ``steps`` (those committed)."""
        path = Path(run_dir) / "report.json"
        data = json.loads(path.read_text())
        report = cls.__new__(cls)
        report.path = path
        keep = set(steps)
        data["steps"] = [s for s in data.get("steps", []) if s.get("step") in keep]
        data.pop("completed", None)
        data.pop("interrupted", None)
        report.data = data
        report.write()
        return report

    def set(self, **fields) -> None:
        self.data.update(fields)
        self.write()

    def placement_since(self, pools: dict) -> dict:
        """What the pools did since the previous call (``pools``: a ``gyreflow_pools`` reply); the
        first call only notes where they started."""
        from gyreflow.cluster.status import between

        before, self._pools = getattr(self, "_pools", None), pools
        return between(before or pools, pools)

    def add_step(self, entry: dict) -> None:
        self.data["steps"].append(entry)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=float) + "\n")
        os.replace(tmp, self.path)
