"""File-defined task suites: loading, workspaces, grading, and the example suite."""

import dataclasses
import json
from pathlib import Path

import psutil
import pytest

from gyreflow.agents.suite import SuiteTask, apply_solution, grade_workspace, load_suite, prepare_workspace

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "repo_tasks"


def make_task(suite: Path, name: str, spec: dict | str | None, workspace: dict | None = None) -> Path:
    """Write a task directory: ``spec`` as task.json (a str is written verbatim), ``workspace`` files."""
    task_dir = suite / name
    task_dir.mkdir(parents=True)
    if spec is not None:
        (task_dir / "task.json").write_text(spec if isinstance(spec, str) else json.dumps(spec))
    if workspace is not None:
        (task_dir / "workspace").mkdir()
        for path, content in workspace.items():
            (task_dir / "workspace" / path).write_text(content)
    return task_dir


def test_example_suite_loads():
    tasks = load_suite(EXAMPLES)
    assert [t.task_id for t in tasks] == sorted(t.task_id for t in tasks)
    assert len(tasks) == 6
    assert sum(t.split == "train" for t in tasks) == 4 and sum(t.split == "heldout" for t in tasks) == 2
    for task in tasks:
        assert task.kind == "suite" and Path(task.workspace).is_absolute() and task.solution
        assert SuiteTask.from_json(json.loads(json.dumps(task.to_json()))) == task


def test_example_tasks_fail_as_given_and_pass_when_solved(tmp_path):
    for task in load_suite(EXAMPLES):
        workdir = prepare_workspace(task, tmp_path)
        before = grade_workspace(task, workdir)
        assert before.score < 1.0 and not before.passed, task.task_id
        apply_solution(task, workdir)
        after = grade_workspace(task, workdir)
        assert after.score == 1.0 and after.passed, (task.task_id, after.results)


def test_partial_credit(tmp_path):
    spec = {"prompt": "p", "tests": ["test -f present", "test -f absent", "exit 0", "exit 3"]}
    make_task(tmp_path / "suite", "partial", spec, {"present": ""})
    (task,) = load_suite(tmp_path / "suite")
    grade = grade_workspace(task, prepare_workspace(task, tmp_path / "work"))
    assert grade.score == 0.5 and not grade.passed
    assert [r["returncode"] for r in grade.results] == [0, 1, 0, 3]
    assert [r["passed"] for r in grade.results] == [True, False, True, False]


GOOD = {"prompt": "do it", "tests": ["true"]}


@pytest.mark.parametrize(
    "spec, workspace, problem",
    [
        (None, {}, r"task\.json: missing"),
        ("{not json", {}, "not valid JSON"),
        ({"tests": ["true"]}, {}, "'prompt' is required"),
        ({"prompt": "p", "tests": "true"}, {}, "'tests' must be a list"),
        ({"prompt": "p", "tests": []}, {}, "'tests' must hold at least one"),
        ({"prompt": "p"}, {}, "'tests' must be a list"),
        ({**GOOD, "split": "test"}, {}, "'split' must be one of"),
        ({**GOOD, "test_timeout_s": -1}, {}, "'test_timeout_s' must be a positive number"),
        ({**GOOD, "tset": []}, {}, r"unknown field\(s\) \['tset'\]"),
        (GOOD, None, "workspace: missing"),
        ({**GOOD, "solution": [{"path": "/etc/x", "content": ""}]}, {}, "'solution'.*must be relative"),
        ({**GOOD, "solution": [{"path": "a/../../x", "content": ""}]}, {}, r"'solution'.*no '\.\.'"),
        ({**GOOD, "solution": [{"path": "x"}]}, {}, "'solution' item 0 must be an object"),
    ],
)
def test_bad_suites_name_the_problem(tmp_path, spec, workspace, problem):
    make_task(tmp_path, "bad_task", spec, workspace)
    with pytest.raises(ValueError, match=problem) as info:
        load_suite(tmp_path)
    assert "bad_task" in str(info.value)


def test_empty_or_missing_suite(tmp_path):
    with pytest.raises(ValueError, match="no task directories"):
        load_suite(tmp_path)
    with pytest.raises(ValueError, match="not a directory"):
        load_suite(tmp_path / "absent")


def test_prepare_workspace_copies_fresh_and_runs_setup(tmp_path):
    spec = {**GOOD, "setup": ["echo ran >> setup.log"]}
    make_task(tmp_path / "suite", "t", spec, {"file.txt": "original"})
    (task,) = load_suite(tmp_path / "suite")
    first = prepare_workspace(task, tmp_path / "work")
    (first / "file.txt").write_text("changed")
    second = prepare_workspace(task, tmp_path / "work")
    assert first != second
    assert (second / "file.txt").read_text() == "original"
    assert (first / "setup.log").read_text() == (second / "setup.log").read_text() == "ran\n"
    assert not (Path(task.workspace) / "setup.log").exists()
    assert (Path(task.workspace) / "file.txt").read_text() == "original"


def test_failing_setup_is_an_error(tmp_path):
    make_task(tmp_path / "suite", "t", {**GOOD, "setup": ["echo broken >&2; exit 4"]}, {})
    (task,) = load_suite(tmp_path / "suite")
    with pytest.raises(RuntimeError, match="(?s)setup command.*exit status 4.*broken"):
        prepare_workspace(task, tmp_path / "work")


def test_hanging_test_is_cut_and_fails_and_its_children_are_killed(tmp_path):
    tests = ["sleep 60", "setsid sleep 300 & echo $! > bg.pid", "true"]
    make_task(tmp_path / "suite", "t", {"prompt": "p", "tests": tests, "test_timeout_s": 1}, {})
    (task,) = load_suite(tmp_path / "suite")
    workdir = prepare_workspace(task, tmp_path / "work")
    grade = grade_workspace(task, workdir)
    assert grade.results[0]["timed_out"] and not grade.results[0]["passed"]
    assert grade.results[1]["passed"] and grade.results[2]["passed"]
    assert grade.score == pytest.approx(2 / 3)
    assert not psutil.pid_exists(int((workdir / "bg.pid").read_text()))


def test_apply_solution_writes_nested_files(tmp_path):
    spec = {**GOOD, "solution": [{"path": "pkg/mod.py", "content": "X = 1\n"}]}
    make_task(tmp_path / "suite", "t", spec, {})
    (task,) = load_suite(tmp_path / "suite")
    workdir = prepare_workspace(task, tmp_path / "work")
    apply_solution(task, workdir)
    assert (workdir / "pkg" / "mod.py").read_text() == "X = 1\n"
    with pytest.raises(ValueError, match="has no solution"):
        apply_solution(dataclasses.replace(task, solution=()), workdir)


def test_task_directory_names_must_fit_execution_ids(tmp_path):
    make_task(tmp_path, "add two numbers", {"prompt": "p", "tests": ["true"]}, {})
    with pytest.raises(ValueError, match="must match"):
        load_suite(tmp_path)


def test_protected_checks_are_restored_before_grading(tmp_path):
    """An agent that rewrites the check its test runs does not pass by it."""
    tasks = {t.task_id: t for t in load_suite(EXAMPLES)}
    greet = tasks["greet"]
    assert greet.protected == ("check_*.py",)
    workdir = prepare_workspace(greet, tmp_path)
    before = grade_workspace(greet, workdir).score
    for check in workdir.glob("check_*.py"):
        check.write_text("raise SystemExit(0)\n")
    assert grade_workspace(greet, workdir).score == before < 1.0
    apply_solution(greet, workdir)
    assert grade_workspace(greet, workdir).passed


def test_protected_patterns_must_stay_inside(tmp_path):
    make_task(tmp_path, "t", {"prompt": "p", "tests": ["true"], "protected": ["../x"]}, {})
    with pytest.raises(ValueError, match="protected"):
        load_suite(tmp_path)
