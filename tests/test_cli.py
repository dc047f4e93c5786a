"""The command line on bad input and on Ctrl-C: clear errors, non-zero exits, nothing half-written."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import zarr
from support import wait_for_steps

from gyreflow.bench import load_workload

GYREFLOW = [sys.executable, "-m", "gyreflow.cli"]


def run_cli(*args, cwd=None, timeout=120):
    return subprocess.run([*GYREFLOW, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


class Result:
    def __init__(self, code: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = code, stdout, stderr


def invoke(*args) -> Result:
    """The command line in this process (click's runner): what a shell would see, without paying a
    fresh interpreter's imports for every refusal."""
    from click.testing import CliRunner

    from gyreflow.cli import main

    r = CliRunner().invoke(main, list(args), catch_exceptions=False)
    return Result(r.exit_code, r.stdout, r.stderr)


def test_invalid_config_names_field_and_allowed_values(tmp_path):
    out = tmp_path / "run"
    p = invoke("run", "--out", str(out), "--set", "rl.loss=dpo")
    assert p.returncode == 2
    assert "rl.loss" in p.stderr and "ppo_clip" in p.stderr and "reinforce" in p.stderr
    assert not out.exists()
    p = invoke("run", "--out", str(out), "--set", "task.horizon=zero")
    assert p.returncode == 2 and "task.horizon must be an integer" in p.stderr
    p = invoke("run", "--out", str(out), "--set", "rl.bogus=1")
    assert p.returncode == 2 and "unknown field rl.bogus" in p.stderr and "staleness" in p.stderr
    assert not out.exists()


def test_config_file_errors(tmp_path):
    bad = tmp_path / "cfg.json"
    bad.write_text("{not json")
    p = invoke("run", "--out", str(tmp_path / "run"), "--config", str(bad))
    assert p.returncode == 2 and "not valid JSON" in p.stderr
    bad.write_text(json.dumps({"rl": {"samples_per_task": 1}}))
    p = invoke("run", "--out", str(tmp_path / "run"), "--config", str(bad))
    assert p.returncode == 2 and "rl.samples_per_task must be >= 2" in p.stderr
    p = invoke("run", "--out", str(tmp_path / "run"), "--config", str(tmp_path / "missing.json"))
    assert p.returncode == 2 and "does not exist" in p.stderr
    assert not (tmp_path / "run").exists()


def test_unknown_pipeline_lists_available(tmp_path):
    p = invoke("run", "--pipeline", "nope", "--out", str(tmp_path / "run"))
    assert p.returncode == 2 and "unknown pipeline 'nope'" in p.stderr and "grpo" in p.stderr
    assert not (tmp_path / "run").exists()


def test_scheduler_that_does_not_answer(tmp_path):
    p = invoke("run", "--scheduler", "tcp://127.0.0.1:9", "--connect-timeout", "1", "--out", str(tmp_path / "run"))
    assert p.returncode != 0
    assert "no Dask scheduler answered at tcp://127.0.0.1:9 within 1s" in (p.stdout + p.stderr)
    assert not (tmp_path / "run").exists()


def test_existing_run_directory_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "report.json").write_text("{}")
    p = invoke("run", "--out", str(out))
    assert p.returncode == 2 and "already exists" in p.stderr
    assert (out / "report.json").read_text() == "{}"


def test_inspect_missing_run_directory(tmp_path):
    p = invoke("inspect", str(tmp_path / "nope"))
    assert p.returncode == 2 and "does not exist" in p.stderr


def test_ctrl_c_leaves_committed_steps_readable(tmp_path, tiny_overrides):
    out = tmp_path / "run"
    args = [a for o in tiny_overrides + ["rl.steps=5000", "rl.staleness=0"] for a in ("--set", o)]
    # A child inherits an ignored SIGINT (cluster start-up in this process ignores it for a while):
    # give the run the default a terminal would.
    proc = subprocess.Popen([*GYREFLOW, "run", "--out", str(out), "--sft-cache", "", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    report = out / "report.json"
    try:
        wait_for_steps(proc, report, 2)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, output
    assert "interrupted" in output
    data = json.loads(report.read_text())
    assert data["interrupted"] is True
    root = zarr.open_group(str(out / "archive.zarr"), mode="r")
    committed = list(root.attrs["committed_steps"])
    assert committed[:2] == [0, 1]
    # Every committed step is whole: each listed execution is in a complete segment, with its arrays.
    for step in committed:
        group = root[f"steps/{step:06d}"]
        for eid, entry in group.attrs["executions"].items():
            seg = group[f"segments/{entry['segment']}"]
            assert seg.attrs["complete"] is True
            (mine,) = [e for e in seg.attrs["executions"] if e["execution_id"] == eid]
            a, b = mine["slices"]["call_meta"]
            assert b - a == entry["n_calls"] and b <= seg["call_meta"].shape[0]


def test_pool_configs_that_cannot_work_are_refused(tmp_path):
    out = tmp_path / "run"
    p = invoke("run", "--out", str(out), "--set", "cluster.placement=sometimes")
    assert p.returncode == 2 and "cluster.placement: unknown mode 'sometimes'; allowed: async, colocated, elastic, lend" in p.stderr
    p = invoke("run", "--out", str(out), "--set", "cluster.rollout_workers=0")
    assert p.returncode == 2 and "cluster.rollout_workers must be >= 1" in p.stderr
    assert not out.exists()


def test_more_cells_than_the_cluster_has_is_refused(tmp_path):
    from distributed import Client

    from gyreflow.cluster.local import PoolSpec, local_cluster

    with local_cluster(PoolSpec(rollout=1, trainer=1, execution_slots=2)) as cluster, Client(cluster) as client:
        addr = client.scheduler.address
        p = run_cli("run", "--out", str(tmp_path / "run"), "--scheduler", addr, "--set", "cluster.rollout_workers=3")
        assert p.returncode == 2, p.stdout + p.stderr
        assert "asks for 4 cells (3 rollout + 1 trainer) but the cluster has 2" in p.stdout
        assert not client.futures  # nothing was submitted


def test_bench_placement_bad_input(tmp_path):
    p = invoke("bench", "placement", "--modes", "elastic,fast")
    assert p.returncode == 2 and "unknown mode(s) 'fast'" in p.stderr
    p = invoke("bench", "placement", "--repeats", "0")
    assert p.returncode == 2 and "--repeats" in p.stderr
    p = invoke("bench", "placement", "--workload", str(tmp_path / "none.json"))
    assert p.returncode == 2 and "none.json" in p.stderr
    p = invoke("bench", "placement", "--split", "9:9")
    assert p.returncode == 2 and "sum to the workload's 8 cells" in p.stderr
    bad = tmp_path / "w.json"
    bad.write_text(json.dumps({"name": "w"}))
    p = invoke("bench", "placement", "--workload", str(bad))
    assert p.returncode == 2 and "w.json" in p.stderr
    for scale in ("nan", "inf", "0"):
        p = invoke("bench", "placement", "--time-scale", scale)
        assert p.returncode == 2 and "--time-scale must be between 0.001 and 10000" in p.stderr
    two = tmp_path / "two.json"
    two.write_text(json.dumps(load_workload("flat").to_dict() | {"cells": 2}))
    p = invoke("bench", "placement", "--workload", str(two), "--modes", "elastic")
    assert p.returncode == 2 and "arm 'elastic' at 1:1 cannot run" in p.stderr and "Traceback" not in p.stderr


def test_placement_tables_from_benchmark_json(tmp_path):
    """The README tables come from the benchmark's JSON: every arm's mean, every ratio, the bounds
    and the time scale, written between the markers and nowhere else."""
    src = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "placement-grow.json"
    out = json.loads(src.read_text())
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- placement-tables:start -->\nold\n<!-- placement-tables:end -->\ntail\n")
    p = invoke("bench", "placement-tables", str(src), "--update", str(readme))
    assert p.returncode == 0, p.stderr
    text = readme.read_text()
    assert text.startswith("intro\n<!-- placement-tables:start -->\n") and text.endswith("<!-- placement-tables:end -->\ntail\n")
    assert "old" not in text
    for arm, m in out["modes"].items():
        row = next(line for line in text.splitlines() if line.startswith(f"| {out['workload']} | {arm} |"))
        assert f"{round(m['emulated_s']['mean']):,}" in row and m["split"] in row
    elastic_vs_oracle = out["ratios"]["elastic_vs_async_oracle"]
    assert f"{elastic_vs_oracle['mean']:.2f} ({elastic_vs_oracle['min']:.2f}–{elastic_vs_oracle['max']:.2f})" in text
    assert f"| time scale, execution workers | x{out['time_scale']:g}," in text

    missing = tmp_path / "plain.md"
    missing.write_text("no markers\n")
    p = invoke("bench", "placement-tables", str(src), "--update", str(missing))
    assert p.returncode == 2 and "placement-tables:start" in p.stderr
    assert missing.read_text() == "no markers\n"
    notjson = tmp_path / "x.json"
    notjson.write_text(json.dumps({"workload": "w"}))
    p = invoke("bench", "placement-tables", str(src), str(notjson))
    assert p.returncode == 2 and f"{notjson}: not a placement benchmark JSON" in p.stderr
    for i, body in enumerate([b'{"modes": []}', b"\xff\xfe", json.dumps(out | {"ratios": {"elastic_vs_lend": "x"}}).encode()]):
        odd = tmp_path / f"odd{i}.json"
        odd.write_bytes(body)
        p = invoke("bench", "placement-tables", str(odd))
        assert p.returncode == 2 and f"{odd}: not a placement benchmark JSON" in p.stderr, p.stderr


def test_bench_jmax_runs_each_value_with_the_same_seeds(tmp_path, tiny_overrides):
    args = [a for o in tiny_overrides + ["rl.steps=1", "rl.staleness=0"] for a in ("--set", o)]
    out = tmp_path / "jmax.json"
    p = subprocess.run([sys.executable, "-m", "gyreflow.cli", "bench", "jmax", *args, "--values", "1,0",
                        "--out", str(tmp_path / "runs"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    fig = json.loads(out.read_text())
    assert list(fig) == ["j_max=1", "j_max=0"] and fig["j_max=1"]["overrides"] == ["rl.j_max=1"]
    # The same SFT policy and the same held-out tasks: the first held-out pass rate is shared.
    assert fig["j_max=1"]["heldout_pass_rate"][0] == fig["j_max=0"]["heldout_pass_rate"][0]
    for arm in fig.values():
        assert len(arm["heldout_pass_rate"]) == 2 and arm["rl_wall_s"] > 0 and arm["train_s"] >= 0
    bad = subprocess.run([sys.executable, "-m", "gyreflow.cli", "bench", "jmax", "--values", "1,x"],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and "--values must be comma-separated integers, got '1,x'" in bad.stderr
