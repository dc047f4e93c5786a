"""Any Dask cluster: a scheduler and workers started as separate processes with the Dask command
line, a short pipeline run on it with ``gyreflow run --scheduler``, and the elastic policy moving a
cell there by its own decision."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support import wait_for

pytestmark = pytest.mark.timeout(420)

DASK = [sys.executable, "-m", "dask"]
# Settings under which the policy's own rule must move a cell whatever the machine's speed: one
# rollout cell holds every execution (consolidate_batch), so the other is spare, and any ready
# gradient share (Dask's first estimate of an unknown task is 0.5 s) is more training than the
# trainer cell clears within drain_s; with no training work the cell is given back to rollout.
RUN_OVERRIDES = [
    "cluster.placement=elastic", "cluster.rollout_workers=2", "cluster.trainer_workers=1",
    "cluster.consolidate_batch=64", "cluster.dwell_s=0.5", "cluster.idle_s=0.5", "cluster.drain_s=0.05",
    "rl.steps=3", "rl.tasks_per_step=6", "rl.samples_per_task=4", "rl.shares_per_group=2",
]


def _env() -> dict:
    env = dict(os.environ)
    env.setdefault("DASK_LOGGING__DISTRIBUTED", "error")
    return env


@pytest.fixture()
def dask_cluster(tmp_path):
    """``dask scheduler`` plus ``dask worker`` processes: 2 rollout cells, 1 trainer cell, 1 execution
    worker; the scheduler address."""
    sched_file = tmp_path / "scheduler.json"
    procs = [subprocess.Popen([*DASK, "scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                               "--scheduler-file", str(sched_file)], env=_env(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)]
    try:
        wait_for(lambda: sched_file.is_file() and sched_file.stat().st_size > 0, timeout=60, what="the scheduler file")
        address = json.loads(sched_file.read_text())["address"]
        workers = [("cell-0", "rollout=1,trainer=0", 2), ("cell-1", "rollout=1,trainer=0", 2),
                   ("cell-2", "rollout=0,trainer=1", 2), ("execution-0", "execution=16", 16)]
        for name, resources, threads in workers:
            procs.append(subprocess.Popen([*DASK, "worker", address, "--name", name, "--resources", resources,
                                           "--nthreads", str(threads), "--nworkers", "1", "--host", "127.0.0.1",
                                           "--no-dashboard"], env=_env(), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        from distributed import Client

        with Client(address, timeout=30) as client:
            client.wait_for_workers(len(workers), timeout=120)
        yield address
    finally:
        # The test is over: no graceful close (about 8 s), each process group (nanny and its worker) goes at once.
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(timeout=30)


def test_elastic_moves_cells_on_a_dask_command_line_cluster(dask_cluster, tmp_path, tiny_overrides):
    out = tmp_path / "run"
    overrides = [o for o in tiny_overrides if not o.startswith(("cluster.placement", "cluster.rollout_workers"))]
    args = [sys.executable, "-m", "gyreflow.cli", "run", "--scheduler", dask_cluster, "--out", str(out),
            "--sft-cache", str(tmp_path / "sft")]
    for o in overrides + RUN_OVERRIDES:
        args += ["--set", o]
    p = subprocess.run(args, capture_output=True, text=True, timeout=360, env=_env())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["completed"] and [s["step"] for s in report["steps"]] == [0, 1, 2]
    placement = report["placement"]
    # The policy itself moved cells: no move was asked from outside, and none failed.
    assert placement["moves"] > 0, placement["move_log"]
    assert placement["moves_failed"] == 0 and not placement["stalls"]
    assert all(m["reason"] != "asked" for m in placement["move_log"])
    per_step = [s["placement"] for s in report["steps"]]
    assert sum(s["moves"] for s in per_step) <= placement["moves"]
    assert "placement: cells (rollout/trainer)" in p.stdout
    assert Path(out, "checkpoints", "final", "config.json").is_file()


def test_the_client_example_runs_against_a_dask_command_line_cluster(dask_cluster, tmp_path, tiny_overrides):
    example = Path(__file__).resolve().parent.parent / "examples" / "client" / "notebook.py"
    overrides = [o for o in tiny_overrides if not o.startswith(("cluster.placement", "cluster.rollout_workers"))]
    args = [sys.executable, str(example), dask_cluster, "--out", str(tmp_path / "run")]
    for o in overrides + ["cluster.placement=async"]:
        args += ["--set", o]
    p = subprocess.run(args, capture_output=True, text=True, timeout=360, env=_env())
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "dashboard: http" in p.stdout and "held-out pass rate" in p.stdout
    assert "step 0:" in p.stdout and "step 1:" in p.stdout and "replayed 2 steps at J_max 1" in p.stdout
    replayed = json.loads((tmp_path / "run-jmax1" / "report.json").read_text())
    assert replayed["config"]["rl"]["j_max"] == 1 and replayed["completed"] is True
