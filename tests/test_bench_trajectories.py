"""`gyreflow bench trajectories` end to end at a tiny size: the JSON other tools read."""

import json
import subprocess
import sys

from gyreflow.bench.trajectories import branching_execution
from gyreflow.trajectory.tree import build_tree

import numpy as np


def test_branching_executions_share_the_requested_prefix():
    tree = build_tree(branching_execution(np.random.default_rng(0), "e", 200, 0.8, 8))
    paths = tree.paths()
    assert tree.n_leaves == 8 and all(len(p) == 200 for p in paths)
    # 160 shared tokens stored once, then 8 branches of 40
    assert tree.unique_tokens == 160 + 8 * 40


def test_bench_trajectories_writes_the_ratios(tmp_path):
    out = tmp_path / "t.json"
    p = subprocess.run([sys.executable, "-m", "gyreflow.cli", "bench", "trajectories", "--repeats", "2",
                        "--executions", "1", "--path-tokens", "40", "--archive-executions", "3", "--archive-calls", "20",
                        "--reduce-groups", "4", "--reduce-shares", "2",
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    data = json.loads(out.read_text())
    assert set(data["jmax_fwd_bwd_fraction"]) == {"1", "5"}
    for ratio in (data["tree_training_speedup"], *data["jmax_fwd_bwd_fraction"].values()):
        assert set(ratio) >= {"mean", "min", "max"} and ratio["min"] <= ratio["mean"] <= ratio["max"]
        assert len(ratio["runs"]) == 2 and ratio["min"] > 0
    # per path: 8 paths x 40 tokens; as one tree: 32 shared + 8 x 8
    assert data["tokens_forwarded"] == {"per_path": 320, "tree": 96}
    assert "tree_training_speedup" in p.stdout
    # Stored tokens: the calls' tokens over the trees' (an agent's prompts extend its earlier calls).
    arch = data["archive"]
    assert data["stored_tokens_ratio"] == arch["call_tokens"] / arch["stored_tokens"] > 3
    # 8 shares each a copy of the parameters, against 2 cell sums and the share in flight.
    red = data["grad_reduce"]
    assert red["before_peak_bytes"] >= 8 * red["parameter_bytes"] and red["after_peak_bytes"] < 4 * red["parameter_bytes"]
    assert data["grad_reduce_peak_memory_ratio"] == red["before_peak_bytes"] / red["after_peak_bytes"]
    for key in ("archive_write_vs_numpy", "archive_read_vs_numpy"):
        assert data[key]["min"] > 0 and len(data[key]["runs"]) == 2


def test_agent_executions_store_each_token_once():
    """Without compaction, retries or sub-agents an agent's calls form one chain: the tree holds
    each token once, so what it stores is the last call's sequence."""
    from gyreflow.bench.trajectories import agent_execution
    from gyreflow.storage.writer import execution_arrays

    ex = agent_execution(np.random.default_rng(1), "chain", calls=6, compact_every=100, retry_every=100,
                         subagent_every=100)
    last = ex.calls[-1]
    assert len(execution_arrays(ex)["tokens"]) == len(last.prompt_ids) + len(last.completion_ids)
