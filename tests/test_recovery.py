"""Replay from an archive and resume after a crash, on a real local cluster with real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from distributed import Client
from safetensors.numpy import load_file
from support import wait_for_steps
from test_cli import GYREFLOW, invoke

from gyreflow.cluster.local import PoolSpec, install_trainers, local_cluster
from gyreflow.config import load_config
from gyreflow.recipes import grpo, replay
from gyreflow.storage import ArchiveReader


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(PoolSpec(rollout=1, trainer=1, execution_slots=8)) as c:
        yield c


def weights(checkpoint: Path) -> dict[str, np.ndarray]:
    return load_file(str(checkpoint / "model.safetensors"))


def test_replaying_an_on_policy_run_reproduces_its_weights(cluster, tmp_path, tiny_overrides):
    cfg = load_config(None, tiny_overrides + ["rl.staleness=0", "rl.steps=3", "rl.eval_every=3", "rl.tasks_per_step=4",
                                             "rl.samples_per_task=4", "optim.lr=0.01", "optim.warmup_steps=0",
                                             "sft.steps=120", "sft.demos=200", "model.hidden_size=64"])
    run_dir = tmp_path / "run"
    with Client(cluster) as client:
        online = grpo.run(client, cfg, run_dir, log=lambda *_: None)
        install_trainers(client, 1)
        again = replay.run(client, cfg, run_dir, tmp_path / "replay", log=lambda *_: None)
        other = replay.run(client, replay.replay_config(ArchiveReader(run_dir / "archive.zarr"), ["rl.j_max=1",
                                                                                                  "optim.lr=0.03"]),
                           run_dir / "archive.zarr", tmp_path / "other", log=lambda *_: None, evaluate=True)
    assert [s["step"] for s in again["steps"]] == [0, 1, 2]
    assert sum(s["train"]["trained_tokens"] for s in online["steps"]) > 0, online["steps"]
    # The same samples trained: token counts per step as online.
    assert [s["train"]["trained_tokens"] for s in again["steps"]] == \
        [s["train"]["trained_tokens"] for s in online["steps"]]
    a, b = weights(run_dir / "checkpoints" / "final"), weights(tmp_path / "replay" / "checkpoints" / "final")
    sft = weights(run_dir / "checkpoints" / "sft")
    assert a.keys() == b.keys()
    diff = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    moved = max(float(np.abs(a[k] - sft[k]).max()) for k in a)
    print(f"replay vs online final weights: max abs difference {diff:.3g} (training moved them by {moved:.3g})")
    assert moved > 1e-3 and diff <= 1e-5
    # Another config trains other weights from the same archive.
    c = weights(tmp_path / "other" / "checkpoints" / "final")
    assert max(float(np.abs(a[k] - c[k]).max()) for k in a) > 1e-4
    report = json.loads((tmp_path / "other" / "report.json").read_text())
    assert report["heldout_pass_rate"] == other["heldout_pass_rate"]
    assert report["config"]["rl"]["j_max"] == 1 and report["completed"] is True
    assert sum(report["heldout_end_reasons"].values()) == cfg.task.heldout_tasks
    assert 0 <= report["heldout_pass_rate"] <= 1


def test_a_killed_driver_resumes_without_a_step_missing_or_doubled(tmp_path, tiny_overrides):
    """Killed after its first commit; with checkpoints every second step, the committed steps after
    the last checkpoint are trained again from the archive, not run again."""
    every = 2
    out = tmp_path / "run"
    steps = 7
    sets = [a for o in tiny_overrides + [f"rl.steps={steps}", "rl.eval_every=4", f"rl.checkpoint_every={every}"]
            for a in ("--set", o)]
    proc = subprocess.Popen([*GYREFLOW, "run", "--out", str(out), "--sft-cache", "", *sets],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    report = out / "report.json"
    try:
        wait_for_steps(proc, report, 1)
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its embedded cluster, as a host failure would
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    before = ArchiveReader(out / "archive.zarr").committed_steps
    assert before and before[-1] < steps - 1

    p = subprocess.run([*GYREFLOW, "run", "--resume", str(out), "--sft-cache", ""], capture_output=True, text=True,
                       timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "resuming from" in p.stdout
    data = json.loads(report.read_text())
    assert [s["step"] for s in data["steps"]] == list(range(steps))
    assert [s["version"] for s in data["steps"]] == list(range(1, steps + 1))
    resumed = data["resumes"][0]
    print("resumed:", resumed)
    assert data["completed"] is True and resumed["first_step"] == before[-1] + 1
    base = -1 if resumed["checkpoint_step"] is None else resumed["checkpoint_step"]
    assert resumed["retrained_steps"] == [s for s in before if s > base]
    assert base == -1 or (base + 1) % every == 0
    reader = ArchiveReader(out / "archive.zarr")
    assert reader.committed_steps == list(range(steps))
    for step in reader.committed_steps:  # each step's executions once, none of another step
        ids = [e for e in reader.executions(step) if e.startswith("execution-")]
        assert len(ids) == 4 and all(e.startswith(f"execution-{step}-") for e in ids)
    assert invoke("inspect", "--verify", str(out)).returncode == 0
    # Nothing in the run directory is a pickle: checkpoints are safetensors and JSON.
    for path in out.rglob("*"):
        if path.is_file():
            assert path.read_bytes()[:2] not in {bytes([0x80, k]) for k in range(2, 6)}, path
    # Continuing a finished run is refused, naming the fix.
    p = invoke("run", "--resume", str(out))
    assert p.returncode == 2 and "raise rl.steps" in p.stderr


def test_resume_refuses_what_is_not_a_run_directory(tmp_path):
    p = invoke("run", "--resume", str(tmp_path / "nope"))
    assert p.returncode == 2 and "no such directory" in p.stderr
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "report.json").write_text("{}")
    p = invoke("run", "--resume", str(tmp_path / "half"))
    assert p.returncode == 2 and "not a gyreflow run directory" in p.stderr and "config.json" in p.stderr
    p = invoke("run", "--resume", str(tmp_path / "half"), "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and "--resume" in p.stderr
    # Nothing written by the refusals.
    assert [f.name for f in (tmp_path / "half").iterdir()] == ["report.json"] and not (tmp_path / "x").exists()
    assert (tmp_path / "half" / "report.json").read_text() == "{}"
