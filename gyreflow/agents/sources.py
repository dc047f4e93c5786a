"""Where a run's tasks come from: the built-in vault suite or a task suite defined by files.

A source gives each step's training tasks, the held-out tasks, the agent configuration their
executions run with, and the demonstrations of the SFT warm start. Pipelines ask the source and
never branch on the kind of task themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from gyreflow.trajectory.records import ExecutionResult


class TaskSource(Protocol):
    def train(self, step: int, n: int) -> list: ...

    def heldout(self) -> list: ...

    def agent(self) -> Any:
        """What ``run_execution`` gets as ``agent`` for these tasks."""
        ...

    def demonstrations(self) -> list[ExecutionResult]: ...


@dataclass
class VaultSource:
    """Procedurally generated vault tasks, run by the native agent."""

    cfg: Any  # RunConfig

    def train(self, step: int, n: int) -> list:
        from gyreflow.agents.tasks import make_tasks

        t = self.cfg.task
        return make_tasks("train", n, t.horizon, t.spare_calls, start=step * n, reply_padding=t.reply_padding)

    def heldout(self) -> list:
        from gyreflow.agents.tasks import make_tasks

        t = self.cfg.task
        return make_tasks("heldout", t.heldout_tasks, t.horizon, t.spare_calls, reply_padding=t.reply_padding)

    def agent(self):
        return self.cfg.agent

    def demonstrations(self) -> list[ExecutionResult]:
        from gyreflow.agents.demos import demonstrations
        from gyreflow.agents.tasks import make_tasks

        c = self.cfg
        tasks = make_tasks("sft", c.sft.demos, c.sft.horizon or c.task.horizon, c.task.spare_calls,
                           reply_padding=c.task.reply_padding)
        return demonstrations(tasks, c.agent, c.sft.noise, seed=c.rl.seed)


@dataclass
class SuiteSource:
    """Tasks of a suite directory (``task.suite``), run by an agent program (``external``)."""

    cfg: Any  # RunConfig

    def __post_init__(self) -> None:
        from gyreflow.agents.suite import load_suite

        tasks = load_suite(self.cfg.task.suite)
        self.train_tasks = [t for t in tasks if t.split == "train"]
        self.heldout_tasks = [t for t in tasks if t.split == "heldout"]
        if not self.train_tasks or not self.heldout_tasks:
            raise ValueError(f"task suite {self.cfg.task.suite} needs train and heldout tasks; it has "
                             f"{len(self.train_tasks)} and {len(self.heldout_tasks)}")

    def train(self, step: int, n: int) -> list:
        # Each step takes the next n tasks, round the suite.
        k = len(self.train_tasks)
        return [self.train_tasks[(step * n + i) % k] for i in range(n)]

    def heldout(self) -> list:
        return self.heldout_tasks[: self.cfg.task.heldout_tasks]

    def agent(self):
        return self.cfg.external

    def demonstrations(self) -> list[ExecutionResult]:
        from gyreflow.agents.teacher import DemoTools, suite_demonstrations
        from gyreflow.model import build_tokenizer
        from gyreflow.proxy.calls import model_card

        ext = self.cfg.external
        return suite_demonstrations(self.train_tasks, ext, model_card(build_tokenizer()),
                                    DemoTools(ext.demo_write_tool, ext.demo_finish_tool))


def task_source(cfg) -> TaskSource:
    """The source ``cfg`` names: a suite directory when ``task.suite`` is set, else the vault."""
    return SuiteSource(cfg) if cfg.task.suite else VaultSource(cfg)
