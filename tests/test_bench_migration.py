"""The migration benchmark runs end to end on a real two-cell cluster and moves the generation
correctly. Speed is never asserted here: only that the figures exist and the bytes and tokens
add up."""

from gyreflow.bench.migration import MAX_NEW, format_migration, run_migration_bench
from gyreflow.model.policy import ModelConfig


def test_migration_bench_small_context():
    lines = []
    result = run_migration_bench(context_tokens=300, repeats=1, log=lines.append)

    for key in ("migration_s", "reprefill_s", "ratio", "kv_bytes", "cached_tokens", "drain_s", "runs",
                "continued", "matches_unmoved", "larger", "model", "seconds"):
        assert key in result, key
    assert result["larger"] is None
    assert result["migration_s"] > 0 and result["reprefill_s"] > 0 and result["drain_s"] > 0
    assert result["ratio"] == result["reprefill_s"] / result["migration_s"]
    assert len(result["runs"]) == 1 and any("repeat 0" in line for line in lines)

    # The KV that crossed the wire is exactly the float32 cache of the tokens it held.
    cfg = ModelConfig()
    head_dim = cfg.hidden_size // cfg.num_heads
    n = result["cached_tokens"]
    assert 300 - 1 <= n < 300 + MAX_NEW
    assert result["kv_bytes"] == cfg.num_layers * 2 * cfg.num_kv_heads * n * head_dim * 4
    run = result["runs"][0]
    assert run["expected_kv_bytes"] == run["kv_bytes"]
    assert run["state_bytes"] > run["kv_bytes"]  # plus the sampler's state
    assert run["reprefill_tokens"] == n + 1  # the re-prefill feeds what the KV held, and the last token

    # The moved generation went on to its max_tokens, equal to the same request never moved.
    assert result["continued"] and run["completion_tokens"] == MAX_NEW
    assert result["matches_unmoved"] is True
    assert run["source"] != run["destination"]
    assert sorted(result["migrated_in"].values()) == [1, 2]  # two warm-up rounds (one each way) + one

    text = format_migration(result)
    assert "migration vs re-prefill:" in text and ("x faster" in text or "x slower" in text)
    assert "300" in text
