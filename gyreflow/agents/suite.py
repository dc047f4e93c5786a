"""Task suites defined by files, so users can bring their own tasks.

A suite is a directory with one subdirectory per task (hidden directories are skipped). Each task
directory holds:

- ``task.json``: the task (fields below);
- ``workspace/``: the small repository the agent works in; every attempt gets a fresh copy.

``task.json`` fields:

- ``prompt`` (str, required): what the agent is asked to do;
- ``tests`` (list of str, required, non-empty): shell commands, each one test; the score is the
  fraction that exit with status 0;
- ``split`` (``"train"`` or ``"heldout"``, default ``"train"``);
- ``time_limit_s`` (number, optional): the agent's time limit for this task;
- ``test_timeout_s`` (number, default 60): the limit of each test command and each setup command;
- ``setup`` (list of str, optional): shell commands run in the fresh copy before the agent starts;
- ``solution`` (list of ``{"path": ..., "content": ...}``, optional): the files a perfect agent
  would write, relative to the workspace; checks that the task is solvable.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from gyreflow.agents.process import ProcessLimits, agent_environment, run_process

SPLITS = ("train", "heldout")
FIELDS = ("prompt", "tests", "split", "time_limit_s", "test_timeout_s", "setup", "solution", "protected")
OUTPUT_CHARS = 2000
"""How much of a test's output a grade keeps."""


@dataclass(frozen=True)
class SuiteTask:
    """One task of a file-defined suite."""

    task_id: str
    """The task's directory name."""
    split: str
    prompt: str
    workspace: str
    """Absolute path of the workspace to copy; never modified."""
    tests: tuple[str, ...]
    time_limit_s: float | None = None
    """The agent's time limit for this task; ``None`` for the agent's default."""
    test_timeout_s: float = 60.0
    setup: tuple[str, ...] = ()
    solution: tuple[tuple[str, str], ...] = ()
    """(path, content) of each file a perfect agent writes."""
    protected: tuple[str, ...] = ()
    """Glob patterns (relative to the workspace) of files put back as given before grading, so an
    agent cannot pass by rewriting the checks its tests run."""

    @property
    def kind(self) -> str:
        return "suite"

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "task_id": self.task_id,
            "split": self.split,
            "prompt": self.prompt,
            "workspace": self.workspace,
            "tests": list(self.tests),
            "time_limit_s": self.time_limit_s,
            "test_timeout_s": self.test_timeout_s,
            "setup": list(self.setup),
            "solution": [{"path": p, "content": c} for p, c in self.solution],
            "protected": list(self.protected),
        }

    @classmethod
    def from_json(cls, data: dict) -> SuiteTask:
        return cls(
            task_id=data["task_id"],
            split=data["split"],
            prompt=data["prompt"],
            workspace=data["workspace"],
            tests=tuple(data["tests"]),
            time_limit_s=data["time_limit_s"],
            test_timeout_s=data["test_timeout_s"],
            setup=tuple(data["setup"]),
            solution=tuple((f["path"], f["content"]) for f in data["solution"]),
            protected=tuple(data.get("protected", ())),
        )


@dataclass
class Grade:
    """The tests' verdict on a workspace."""

    score: float
    """Fraction of the tests that passed."""
    passed: bool
    """Whether every test passed."""
    results: list[dict] = field(default_factory=list)
    """Per test: command, passed, returncode, timed_out, output (tail), error."""


def load_suite(path: str | Path) -> list[SuiteTask]:
    """The tasks of the suite at ``path``, sorted by task id.

    Raises
    ------
    ValueError
        Naming the file and the field, when a task is malformed.
    """
    root = Path(path).resolve()
    if not root.is_dir():
        raise ValueError(f"task suite {root}: not a directory")
    tasks = [_load_task(d) for d in sorted(root.iterdir()) if d.is_dir() and not d.name.startswith(".")]
    if not tasks:
        raise ValueError(f"task suite {root}: no task directories")
    return tasks


TASK_ID = re.compile(r"^[A-Za-z0-9_.-]{1,100}$")
"""Task directory names: they become parts of execution ids and session URLs."""


def _load_task(task_dir: Path) -> SuiteTask:
    spec_path = task_dir / "task.json"
    if not TASK_ID.match(task_dir.name):
        raise ValueError(f"{task_dir}: a task directory's name must match {TASK_ID.pattern} (it names the task "
                         "in execution ids and URLs)")
    if not spec_path.is_file():
        raise ValueError(f"{spec_path}: missing (every task directory needs a task.json)")
    try:
        spec = json.loads(spec_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{spec_path}: not valid JSON ({exc})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{spec_path}: must hold a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(FIELDS))
    if unknown:
        raise ValueError(f"{spec_path}: unknown field(s) {unknown}; known fields are {list(FIELDS)}")

    def bad(name: str, why: str) -> ValueError:
        return ValueError(f"{spec_path}: field {name!r} {why}")

    prompt = spec.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad("prompt", "is required and must be a non-empty string")
    tests = _strings(spec.get("tests"), "tests", bad, required=True)
    setup = _strings(spec.get("setup", []), "setup", bad, required=False)
    split = spec.get("split", "train")
    if split not in SPLITS:
        raise bad("split", f"must be one of {list(SPLITS)}, got {split!r}")
    time_limit_s = spec.get("time_limit_s")
    if time_limit_s is not None:
        time_limit_s = _seconds(time_limit_s, "time_limit_s", bad)
    test_timeout_s = _seconds(spec.get("test_timeout_s", 60.0), "test_timeout_s", bad)
    solution = _solution(spec.get("solution", []), bad)
    protected = _patterns(spec.get("protected", []), bad)
    workspace = task_dir / "workspace"
    if not workspace.is_dir():
        raise ValueError(f"{workspace}: missing (every task directory needs a workspace/ directory)")
    return SuiteTask(
        task_id=task_dir.name,
        split=split,
        prompt=prompt,
        workspace=str(workspace),
        tests=tests,
        time_limit_s=time_limit_s,
        test_timeout_s=test_timeout_s,
        setup=setup,
        solution=solution,
        protected=protected,
    )


def _strings(value, name: str, bad, *, required: bool) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise bad(name, f"must be a list of shell commands, got {type(value).__name__}")
    if required and not value:
        raise bad(name, "must hold at least one command")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise bad(name, f"item {i} must be a non-empty string, got {item!r}")
    return tuple(value)


def _seconds(value, name: str, bad) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise bad(name, f"must be a positive number of seconds, got {value!r}")
    return float(value)


def _solution(value, bad) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, list):
        raise bad("solution", f"must be a list of {{'path', 'content'}} objects, got {type(value).__name__}")
    files = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or set(item) != {"path", "content"}:
            raise bad("solution", f"item {i} must be an object with exactly 'path' and 'content'")
        path, content = item["path"], item["content"]
        if not isinstance(path, str) or not isinstance(content, str):
            raise bad("solution", f"item {i}: 'path' and 'content' must be strings")
        problem = _escapes(path)
        if problem:
            raise bad("solution", f"item {i}: path {path!r} {problem}")
        files.append((path, content))
    return tuple(files)


def _patterns(value, bad) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise bad("protected", "must be a list of glob patterns relative to the workspace")
    for pattern in value:
        problem = _escapes(pattern)
        if problem:
            raise bad("protected", f"pattern {pattern!r} {problem}")
    return tuple(value)


def restore_protected(task: SuiteTask, workdir: str | Path) -> list[str]:
    """Put the task's protected files back as the workspace gives them; the paths restored."""
    source, workdir = Path(task.workspace), Path(workdir)
    restored = []
    for pattern in task.protected:
        for original in sorted(source.glob(pattern)):
            if original.is_file():
                rel = original.relative_to(source)
                target = workdir / rel
                if target.is_symlink():  # a link could point the copy anywhere
                    target.unlink()
                elif target.is_dir():
                    shutil.rmtree(target)
                for parent in reversed(rel.parents[:-1]):  # a file or link where a folder belongs
                    where = workdir / parent
                    if where.is_symlink() or (where.exists() and not where.is_dir()):
                        where.unlink()
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(original, target)
                restored.append(str(rel))
    return restored


def _escapes(path: str) -> str:
    """Why ``path`` is not a plain path inside the workspace, or empty when it is."""
    pure = PurePosixPath(path)
    if not path or path.startswith(("/", "\\")) or pure.is_absolute() or (len(path) > 1 and path[1] == ":"):
        return "must be relative to the workspace"
    if ".." in pure.parts or ".." in path.split("\\"):
        return "must stay inside the workspace (no '..')"
    if pure == PurePosixPath("."):
        return "must name a file"
    return ""


def prepare_workspace(task: SuiteTask, root: str | Path, env: dict[str, str] | None = None) -> Path:
    """A fresh copy of the task's workspace under ``root``, with ``setup`` run in it.

    Raises
    ------
    RuntimeError
        When a setup command fails: the task is broken, not the agent.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=f"{task.task_id}-", dir=root))
    shutil.copytree(task.workspace, workdir, symlinks=True, dirs_exist_ok=True)
    env = agent_environment({}) if env is None else env
    for command in task.setup:
        outcome = run_process(["bash", "-c", command], workdir, env, ProcessLimits(time_limit_s=task.test_timeout_s))
        if outcome.returncode != 0:
            why = outcome.error or ("timed out" if outcome.timed_out else f"exit status {outcome.returncode}")
            raise RuntimeError(
                f"task {task.task_id}: setup command {command!r} failed ({why}):\n"
                f"{_output(outcome.stdout_tail, outcome.stderr_tail)}"
            )
    return workdir


def grade_workspace(task: SuiteTask, workdir: str | Path, env: dict[str, str] | None = None) -> Grade:
    """Run the task's tests in ``workdir``; never raises for a failing, hanging or missing test.

    Each test runs as ``bash -c COMMAND`` under :func:`run_process` with ``test_timeout_s``, so
    whatever a test starts is contained like an agent's programs.
    """
    env = agent_environment({}) if env is None else env
    restore_protected(task, workdir)
    limits = ProcessLimits(time_limit_s=task.test_timeout_s)
    results = []
    for command in task.tests:
        outcome = run_process(["bash", "-c", command], workdir, env, limits)
        results.append(
            {
                "command": command,
                "passed": outcome.returncode == 0 and not outcome.timed_out,
                "returncode": outcome.returncode,
                "timed_out": outcome.timed_out,
                "output": _output(outcome.stdout_tail, outcome.stderr_tail),
                "error": outcome.error,
            }
        )
    n_passed = sum(r["passed"] for r in results)
    return Grade(score=n_passed / len(results), passed=n_passed == len(results), results=results)


def _output(stdout: str, stderr: str) -> str:
    return (stdout + stderr)[-OUTPUT_CHARS:]


def apply_solution(task: SuiteTask, workdir: str | Path) -> None:
    """Write the task's solution files into ``workdir``."""
    if not task.solution:
        raise ValueError(f"task {task.task_id} has no solution")
    workdir = Path(workdir).resolve()
    for path, content in task.solution:
        target = (workdir / path).resolve()
        if workdir not in target.parents:
            raise ValueError(f"task {task.task_id}: solution path {path!r} leaves the workspace")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content, encoding="utf-8")
