"""Running an agent program as a bounded subprocess.

:func:`run_process` starts a small supervisor process (this file, run as a script) that forks the
program, applies resource limits, enforces the time limit and, once the program has ended, kills
whatever it left behind. The supervisor is a *child subreaper* on Linux: a descendant that
daemonizes (double fork, ``setsid``) is re-parented to the supervisor rather than to init, so no
descendant can slip out of reach however quickly its parent exits. Where subreapers do not exist the
supervisor falls back to polling the process tree while the program runs.

Both the supervisor and the program receive ``SIGKILL`` when their parent dies
(``PR_SET_PDEATHSIG``), so a crashed Dask worker does not leave its agents running.

The supervisor forks from a single-threaded process, which keeps :func:`run_process` safe to call
from many threads at once: the calling process itself only ever uses :class:`subprocess.Popen`
without a ``preexec_fn``. Written for Linux; elsewhere on POSIX it works without the parent-death
signal and with the polling fallback.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

TAIL_CHARS = 4000
"""How much of the end of stdout and of stderr an outcome keeps."""

DEFAULT_INHERIT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV", "SYSTEMROOT")

# Time the supervisor may need beyond the program's own limits (its start-up and the final sweep)
# before the caller gives up on it.
_SUPERVISOR_SLACK_S = 30.0
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_EXEC_FAILED = 127


@dataclass(frozen=True)
class ProcessLimits:
    """Bounds on one run of a program."""

    time_limit_s: float = 600.0
    """Wall-clock limit; then the program's process group gets SIGTERM, later SIGKILL."""
    memory_mb: int | None = 4096
    """Address-space limit (``RLIMIT_AS``) in MiB; ``None`` for none."""
    cpu_s: int | None = None
    """CPU-time limit (``RLIMIT_CPU``) in seconds; ``None`` for none."""
    file_mb: int | None = 1024
    """Largest file the program may write (``RLIMIT_FSIZE``) in MiB; ``None`` for none."""
    kill_grace_s: float = 2.0
    """Time between SIGTERM and SIGKILL when the time limit is reached."""

    def __post_init__(self):
        for name in ("time_limit_s", "kill_grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"ProcessLimits.{name} must be a finite number, got {value!r}")
            if value <= 0:
                raise ValueError(f"ProcessLimits.{name} must be positive, got {value!r}")
        for name in ("memory_mb", "cpu_s", "file_mb"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ProcessLimits.{name} must be a positive integer or None, got {value!r}")


@dataclass
class ProcessOutcome:
    """How a run of a program ended."""

    returncode: int | None
    """Exit status; ``-N`` when killed by signal N; ``None`` when the program never ran."""
    timed_out: bool
    """Whether the time limit ended the run."""
    wall_s: float
    """Seconds from the start of the program to its end."""
    stdout_tail: str
    """The last :data:`TAIL_CHARS` characters of standard output."""
    stderr_tail: str
    """The last :data:`TAIL_CHARS` characters of standard error."""
    killed: int
    """Processes killed at the end: the program when it timed out, and every descendant left."""
    error: str = ""
    """Why the program could not be run (bad program or working directory), else empty."""


def agent_environment(extra: dict[str, str], *, inherit: tuple[str, ...] = DEFAULT_INHERIT) -> dict[str, str]:
    """An environment for a program: the ``inherit`` variables of this process, plus ``extra``.

    Nothing else leaks from this process (credentials, scheduler addresses), so a program sees
    only what it is given.
    """
    env = {name: os.environ[name] for name in inherit if name in os.environ}
    env.update(extra)
    return env


def run_process(
    argv: list[str],
    cwd: str | Path,
    env: dict[str, str],
    limits: ProcessLimits,
    *,
    stdin: str | None = None,
) -> ProcessOutcome:
    """Run ``argv`` in ``cwd`` with exactly ``env`` under ``limits``; wait for it and clean up.

    Parameters
    ----------
    argv
        The program and its arguments; the program is looked up on ``env["PATH"]``.
    cwd
        Working directory of the program.
    env
        The program's whole environment (see :func:`agent_environment`).
    limits
        Time, memory, CPU and file-size bounds.
    stdin
        Text given on standard input; none (``/dev/null``) by default.

    Returns
    -------
    ProcessOutcome
        Whatever the program did. A program that cannot be started gives ``returncode=None`` and
        an ``error``; nothing the program does makes this function raise. When it returns, no
        process the program started is left running.

    Raises
    ------
    ValueError
        When ``argv``, ``env`` or ``limits`` are malformed (a caller's mistake, not the program's).
    """
    _check_call(argv, env, limits)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gyreflow-run-") as tmp:
        tmp_dir = Path(tmp)
        spec_path, result_path = tmp_dir / "spec.json", tmp_dir / "result.json"
        spec = {
            "argv": list(argv),
            "cwd": str(Path(cwd).absolute()),
            "env": dict(env),
            "limits": {
                "time_limit_s": limits.time_limit_s,
                "memory_mb": limits.memory_mb,
                "cpu_s": limits.cpu_s,
                "file_mb": limits.file_mb,
                "kill_grace_s": limits.kill_grace_s,
            },
            "parent_pid": os.getpid(),
            "result": str(result_path),
        }
        spec_path.write_text(json.dumps(spec))
        stdin_path = Path(os.devnull)
        if stdin is not None:
            stdin_path = tmp_dir / "stdin"
            stdin_path.write_text(stdin, encoding="utf-8")
        with open(tmp_dir / "stdout", "w+b") as out, open(tmp_dir / "stderr", "w+b") as err:
            with open(stdin_path, "rb") as inp:
                returned = _supervise_from_caller(spec_path, limits, inp, out, err)
            report = _read_report(result_path)
            if report is None:
                report = {
                    "returncode": None,
                    "timed_out": False,
                    "killed": 0,
                    "wall_s": time.monotonic() - started,
                    "error": f"the process supervisor ended without a report (exit status {returned})",
                }
            return ProcessOutcome(
                returncode=report["returncode"],
                timed_out=report["timed_out"],
                wall_s=report["wall_s"],
                stdout_tail=_tail(out),
                stderr_tail=_tail(err),
                killed=report["killed"],
                error=report["error"],
            )


def _check_call(argv, env, limits) -> None:
    if not isinstance(argv, (list, tuple)) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env must be a dict of strings to strings")
    if not isinstance(limits, ProcessLimits):
        raise ValueError(f"limits must be a ProcessLimits, got {type(limits).__name__}")


def _supervise_from_caller(spec_path: Path, limits: ProcessLimits, inp, out, err) -> int | None:
    """Start the supervisor and wait for it; returns its exit status."""
    try:
        supervisor = subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).resolve()), str(spec_path)],
            stdin=inp,
            stdout=out,
            stderr=err,
            # The program gets the spec's environment at exec; the supervisor keeps this process's,
            # which its interpreter may need (LD_LIBRARY_PATH), and -I makes it ignore PYTHON*.
            close_fds=True,
            start_new_session=True,
        )
    except OSError as exc:
        err.write(f"cannot start the process supervisor: {exc}\n".encode())
        return None
    try:
        return supervisor.wait(timeout=limits.time_limit_s + limits.kill_grace_s + _SUPERVISOR_SLACK_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # Also reached on an exception in this thread (KeyboardInterrupt): SIGTERM asks the
        # supervisor to end the program now and sweep its descendants, as at the time limit.
        if supervisor.poll() is None:
            supervisor.send_signal(signal.SIGTERM)
            try:
                supervisor.wait(timeout=limits.kill_grace_s + 5.0)
            except subprocess.TimeoutExpired:
                os.killpg(supervisor.pid, signal.SIGKILL)
                supervisor.wait()
    return supervisor.returncode


def _read_report(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(stream) -> str:
    stream.flush()
    stream.seek(0, os.SEEK_END)
    size = stream.tell()
    # Up to 4 bytes per character in UTF-8.
    stream.seek(max(0, size - 4 * TAIL_CHARS))
    return stream.read().decode("utf-8", errors="replace")[-TAIL_CHARS:]


# ---------------------------------------------------------------------------------------------
# The supervisor: runs as ``python -I process.py SPEC`` in its own session, single-threaded.
# ---------------------------------------------------------------------------------------------


def _prctl(option: int, value: int) -> bool:
    """``prctl(option, value)``; False where prctl does not exist or refuses."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent dies, including when the parent is already gone."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)


def _set_limits(limits: dict) -> None:
    import resource

    wanted = [
        (resource.RLIMIT_AS, limits["memory_mb"], 1024 * 1024),
        (resource.RLIMIT_CPU, limits["cpu_s"], 1),
        (resource.RLIMIT_FSIZE, limits["file_mb"], 1024 * 1024),
    ]
    for which, amount, unit in wanted:
        if amount is None:
            continue
        _, hard = resource.getrlimit(which)
        value = amount * unit
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        # A hard CPU limit one second above the soft one: SIGXCPU first, then SIGKILL.
        ceiling = value + 1 if which == resource.RLIMIT_CPU else value
        if hard != resource.RLIM_INFINITY:
            ceiling = min(ceiling, hard)
        resource.setrlimit(which, (value, ceiling))


def _exec_program(spec: dict, supervisor_pid: int, report_fd: int) -> None:
    """In the forked child: become the program. Never returns."""
    stage = "cannot start"
    try:
        os.setsid()
        _die_with_parent(supervisor_pid)
        # Python ignores these at start-up; an ignored signal stays ignored across exec.
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)
        stage = f"cannot enter the working directory {spec['cwd']!r}"
        os.chdir(spec["cwd"])
        stage = "cannot set resource limits"
        _set_limits(spec["limits"])
        stage = f"cannot run {spec['argv'][0]!r}"
        os.execvpe(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # noqa: BLE001 - anything here must reach the supervisor
        reason = str(exc)
        if isinstance(exc, FileNotFoundError) and stage.startswith("cannot run") and os.sep not in spec["argv"][0]:
            reason = f"no such program on PATH {os.pathsep.join(os.get_exec_path(spec['env']))!r}"
        try:
            os.write(report_fd, f"{stage}: {reason}".encode("utf-8", errors="replace"))
        finally:
            os._exit(_EXEC_FAILED)


class _Tree:
    """The supervisor's descendants, remembered across polls."""

    def __init__(self, program_pid: int):
        self.me = psutil.Process()
        self.program_pid = program_pid
        self.seen: dict[tuple[int, float], object] = {}

    def living(self) -> list:
        """Descendants now running (not zombies), the program excepted; remembered for later."""
        alive = []
        for proc in self.me.children(recursive=True):
            try:
                if proc.pid == self.program_pid or proc.status() == psutil.STATUS_ZOMBIE:
                    continue
                self.seen[(proc.pid, proc.create_time())] = proc
            except psutil.Error:
                continue
            alive.append(proc)
        # Without a subreaper an orphan leaves our tree; those seen earlier are still ours.
        for proc in self.seen.values():
            if proc not in alive and _is_running(proc):
                alive.append(proc)
        return alive


def _is_running(proc) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _exited(pid: int) -> bool:
    """Whether child ``pid`` has exited, leaving it unreaped so its process-group id stays taken."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _reap_orphans(program_pid: int) -> None:
    """Reap exited children other than the program (orphans handed to us as subreaper)."""
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid == program_pid:
            return
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            return


def _wait_program(pid: int, until: float, tree: _Tree | None, stop: list[bool]) -> bool:
    """Wait until ``pid`` exits (True) or ``until`` passes or a stop is asked for (False)."""
    interval, next_poll = 0.001, 0.0
    while not _exited(pid):
        now = time.monotonic()
        if now >= until or stop[0]:
            return False
        _reap_orphans(pid)
        if tree is not None and now >= next_poll:
            tree.living()
            next_poll = now + 0.2
        time.sleep(min(interval, max(until - now, 0.0)))
        interval = min(interval * 2, 0.05)
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _keys(procs: list) -> set[tuple[int, float]]:
    keys = set()
    for proc in procs:
        try:
            keys.add((proc.pid, proc.create_time()))
        except psutil.Error:
            continue
    return keys


def _sweep(tree: _Tree, program_pid: int, killed: set[tuple[int, float]]) -> int:
    """Kill every descendant still running; returns how many were killed, ``killed`` included."""
    # The unreaped program still holds its process-group id, so this cannot hit a stranger.
    victims = tree.living()
    killed |= _keys(victims)
    _signal_group(program_pid, signal.SIGKILL)
    deadline = time.monotonic() + 10.0
    while victims and time.monotonic() < deadline:
        killed |= _keys(victims)
        for proc in victims:
            try:
                proc.kill()
            except psutil.Error:
                continue
        time.sleep(0.005)
        _reap_orphans(program_pid)
        # Killing a parent hands its children to us; go round until nothing is left.
        victims = tree.living()
    return len(killed)


def _supervise(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    limits = spec["limits"]
    _die_with_parent(spec["parent_pid"])
    subreaper = _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    stop = [False]

    def on_term(signum, frame):
        stop[0] = True

    signal.signal(signal.SIGTERM, on_term)
    report = {"returncode": None, "timed_out": False, "killed": 0, "wall_s": 0.0, "error": ""}

    # Close-on-exec: the program's exec closes the write end, so EOF means it is running.
    read_fd, write_fd = os.pipe()
    supervisor_pid = os.getpid()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _exec_program(spec, supervisor_pid, write_fd)
    os.close(write_fd)
    failure = b""
    while chunk := os.read(read_fd, 4096):
        failure += chunk
    os.close(read_fd)
    if failure:
        os.waitpid(pid, 0)
        report["error"] = failure.decode("utf-8", errors="replace")
        report["wall_s"] = time.monotonic() - started
        Path(spec["result"]).write_text(json.dumps(report))
        return 0

    tree = _Tree(pid)
    polled = None if subreaper else tree
    finished = _wait_program(pid, started + limits["time_limit_s"], polled, stop)
    killed: set[tuple[int, float]] = set()
    if not finished:
        # A SIGTERM from the caller means its own, longer, deadline has passed: a timeout too.
        report["timed_out"] = True
        # Whatever runs now dies of the group's SIGTERM or in the sweep: all of it counts as killed.
        killed = _keys(tree.living())
        _signal_group(pid, signal.SIGTERM)
        if not _wait_program(pid, time.monotonic() + limits["kill_grace_s"], polled, [False]):
            _signal_group(pid, signal.SIGKILL)
            while not _exited(pid):
                time.sleep(0.005)
    report["wall_s"] = time.monotonic() - started
    n_killed = _sweep(tree, pid, killed)
    _, status = os.waitpid(pid, 0)
    report["returncode"] = os.waitstatus_to_exitcode(status)
    report["killed"] = n_killed + (0 if finished else 1)
    _reap_orphans(-1)
    Path(spec["result"]).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(_supervise(sys.argv[1]))
