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
