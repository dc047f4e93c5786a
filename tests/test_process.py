"""Bounded subprocesses: limits, time-outs, and no descendant outliving the call."""

import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from gyreflow.agents.process import TAIL_CHARS, ProcessLimits, agent_environment, run_process
from support import wait_for

REPO = Path(__file__).resolve().parents[1]
QUICK = ProcessLimits(time_limit_s=30.0)


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def read_pid(path: Path) -> int:
    return int(wait_for(lambda: path.exists() and path.read_text().strip(), timeout=10, what=f"a pid in {path}"))


@pytest.fixture
def leftovers():
    """Pids a test expects to be gone; any still running at the end are killed (and fail the test)."""
    pids: list[int] = []
    yield pids
    alive = [pid for pid in pids if running(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"processes left running: {alive}"


def test_exit_code_and_output_tails(tmp_path):
    script = "import sys; print('x' * 10000 + 'END'); print('oops', file=sys.stderr); sys.exit(3)"
    out = run_process([sys.executable, "-c", script], tmp_path, agent_environment({}), QUICK)
    assert out.returncode == 3 and not out.timed_out and out.error == "" and out.killed == 0
    assert len(out.stdout_tail) == TAIL_CHARS and out.stdout_tail.endswith("xEND\n")
    assert out.stderr_tail == "oops\n"
    assert out.wall_s > 0


def test_stdin_and_working_directory(tmp_path):
    (tmp_path / "here.txt").write_text("found")
    out = run_process(["bash", "-c", "cat; cat here.txt"], tmp_path, agent_environment({}), QUICK, stdin="given ")
    assert out.returncode == 0 and out.stdout_tail == "given found"


def test_time_limit_kills_the_program_and_its_group(tmp_path):
    limits = ProcessLimits(time_limit_s=1.0, kill_grace_s=0.5)
    out = run_process(["bash", "-c", "sleep 60 & sleep 60 & wait"], tmp_path, agent_environment({}), limits)
    assert out.timed_out and out.returncode == -signal.SIGTERM
    assert out.killed == 3  # bash and both sleeps


def test_program_ignoring_sigterm_gets_sigkill(tmp_path):
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    )
    limits = ProcessLimits(time_limit_s=1.0, kill_grace_s=0.5)
    out = run_process([sys.executable, "-c", script], tmp_path, agent_environment({}), limits)
    assert out.timed_out and out.returncode == -signal.SIGKILL and out.stdout_tail == "ready\n"


def test_setsid_grandchild_is_killed_when_the_program_exits(tmp_path, leftovers):
    pid_file = tmp_path / "bg.pid"
    command = f"setsid sleep 300 & echo $! > {pid_file}; echo started"
    out = run_process(["bash", "-c", command], tmp_path, agent_environment({}), QUICK)
    leftovers.append(read_pid(pid_file))
    assert out.returncode == 0 and out.stdout_tail == "started\n" and not out.timed_out
    assert out.killed == 1
    assert not psutil.pid_exists(leftovers[0])


def test_double_forked_daemon_is_killed(tmp_path, leftovers):
    pid_file = tmp_path / "daemon.pid"
    script = textwrap.dedent(
        """
        import os, sys, time
        pid_file = sys.argv[1]
        child = os.fork()
        if child == 0:
            os.setsid()
            if os.fork() == 0:
                with open(pid_file + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.rename(pid_file + ".tmp", pid_file)
                time.sleep(300)
            os._exit(0)
        os.waitpid(child, 0)
        while not os.path.exists(pid_file):
            time.sleep(0.01)
        print("daemonized")
        """
    )
    out = run_process([sys.executable, "-c", script, str(pid_file)], tmp_path, agent_environment({}), QUICK)
    leftovers.append(read_pid(pid_file))
    assert out.returncode == 0 and out.stdout_tail == "daemonized\n"
    assert out.killed == 1
    assert not psutil.pid_exists(leftovers[0])


def test_memory_limit_fails_the_program_not_the_caller(tmp_path):
    before = resource.getrlimit(resource.RLIMIT_AS)
    script = "b = bytearray(512 * 1024 * 1024); print('allocated')"
    env = agent_environment({})
    small = run_process([sys.executable, "-c", script], tmp_path, env, ProcessLimits(time_limit_s=30, memory_mb=256))
    assert small.returncode not in (0, None) and "MemoryError" in small.stderr_tail
    large = run_process([sys.executable, "-c", script], tmp_path, env, ProcessLimits(time_limit_s=30, memory_mb=2048))
    assert large.returncode == 0 and large.stdout_tail == "allocated\n"
    assert resource.getrlimit(resource.RLIMIT_AS) == before


def test_cpu_and_file_size_limits(tmp_path):
    env = agent_environment({})
    spin_limits = ProcessLimits(time_limit_s=20, cpu_s=1)
    spin = run_process([sys.executable, "-c", "while True: pass"], tmp_path, env, spin_limits)
    assert not spin.timed_out and spin.returncode in (-signal.SIGXCPU, -signal.SIGKILL)
    write = "open('big', 'wb').write(b'x' * (3 * 1024 * 1024))"
    big = run_process([sys.executable, "-c", write], tmp_path, env, ProcessLimits(time_limit_s=20, file_mb=1))
    # Python ignores SIGXFSZ, so the write fails with EFBIG rather than killing it.
    assert big.returncode == 1 and "File too large" in big.stderr_tail
    assert (tmp_path / "big").stat().st_size <= 1024 * 1024


def test_environment_is_exactly_the_one_given(tmp_path, monkeypatch):
    monkeypatch.setenv("GYREFLOW_TEST_SECRET", "do-not-leak")
    env = agent_environment({"GYREFLOW_TEST_GIVEN": "yes"})
    assert env["GYREFLOW_TEST_GIVEN"] == "yes" and env["PATH"] == os.environ["PATH"]
    assert "GYREFLOW_TEST_SECRET" not in env
    script = "import json, os; print(json.dumps(dict(os.environ)))"
    given = {"PATH": os.environ["PATH"], "ONLY_THIS": "1"}
    # env(1), unlike Python, prints its environment exactly as it received it.
    out = run_process(["env"], tmp_path, given, QUICK)
    assert out.returncode == 0
    seen = dict(line.split("=", 1) for line in out.stdout_tail.splitlines())
    assert seen == given
    out = run_process([sys.executable, "-c", script], tmp_path, env, QUICK)
    assert "GYREFLOW_TEST_SECRET" not in json.loads(out.stdout_tail)


def test_unstartable_programs_give_an_error_not_an_exception(tmp_path):
    env = agent_environment({})
    missing = run_process(["gyreflow-no-such-program", "--flag"], tmp_path, env, QUICK)
    assert missing.returncode is None and "gyreflow-no-such-program" in missing.error and missing.killed == 0
    no_dir = run_process(["true"], tmp_path / "absent", env, QUICK)
    assert no_dir.returncode is None and "working directory" in no_dir.error


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(ValueError, match="argv"):
        run_process([], tmp_path, {}, QUICK)
    with pytest.raises(ValueError, match="env"):
        run_process(["true"], tmp_path, {"A": 1}, QUICK)
    with pytest.raises(ValueError, match="time_limit_s"):
        ProcessLimits(time_limit_s=0)
    with pytest.raises(ValueError, match="kill_grace_s"):
        ProcessLimits(kill_grace_s=float("nan"))
    with pytest.raises(ValueError, match="memory_mb"):
        ProcessLimits(memory_mb=-1)
    with pytest.raises(ValueError, match="cpu_s"):
        ProcessLimits(cpu_s=1.5)


def test_concurrent_calls_from_threads_stay_apart(tmp_path):
    def one(i):
        script = f"import time; time.sleep(0.2); print({i})"
        return run_process([sys.executable, "-c", script], tmp_path, agent_environment({}), QUICK)

    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(one, range(8)))
    assert [o.stdout_tail for o in outs] == [f"{i}\n" for i in range(8)]
    assert all(o.returncode == 0 for o in outs)


HELPER = """
import sys
from gyreflow.agents.process import ProcessLimits, agent_environment, run_process

run_process(["bash", "-c", "echo $$ > " + sys.argv[1] + "; exec sleep 300"], ".",
            agent_environment({}), ProcessLimits(time_limit_s=120))
"""


def test_program_dies_with_its_caller(tmp_path, leftovers):
    pid_file = tmp_path / "child.pid"
    # TMPDIR: the killed caller cannot remove its scratch directory; keep it in tmp_path.
    python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": python_path}
    helper = subprocess.Popen([sys.executable, "-c", HELPER, str(pid_file)], cwd=tmp_path, env=env)
    try:
        pid = read_pid(pid_file)
        leftovers.append(pid)
        tree = [p.pid for p in psutil.Process(helper.pid).children(recursive=True)]
        leftovers.extend(p for p in tree if p != pid)
        assert pid in tree and len(tree) == 2  # the supervisor and the program
        helper.kill()
        helper.wait()
        for p in tree:
            wait_for(lambda: not running(p), timeout=10, what=f"process {p} to die with its caller")
    finally:
        if helper.poll() is None:
            helper.kill()
            helper.wait()
