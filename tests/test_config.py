"""Configuration: defaults, files, overrides and one-line errors that name the field."""

import json
import subprocess
import sys

import pytest

from gyreflow.config import ConfigError, RunConfig, load_config


def test_defaults_are_valid():
    cfg = load_config()
    assert isinstance(cfg, RunConfig)
    assert cfg.rl.advantage == "grpo" and cfg.rl.loss == "ppo_clip"


def test_file_then_overrides(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"rl": {"steps": 3, "staleness": 0}, "task": {"horizon": 9}}))
    cfg = load_config(path, ["rl.steps=5", "sft.noise.p_skip_read=0.5", "rl.advantage=rloo"])
    assert (cfg.rl.steps, cfg.rl.staleness, cfg.task.horizon) == (5, 0, 9)
    assert cfg.sft.noise.p_skip_read == 0.5 and cfg.rl.advantage == "rloo"


@pytest.mark.parametrize(
    "override, message",
    [
        ("rl.advantage=ppo", "rl.advantage: unknown 'ppo'; allowed: dr_grpo, grpo, rloo, tree"),
        ("rl.loss=dpo", "rl.loss: unknown 'dpo'; allowed: ppo_clip, reinforce"),
        ("rl.steps=0", "rl.steps must be > 0"),
        ("rl.steps=1.5", "rl.steps must be an integer"),
        ("rl.staleness=-1", "rl.staleness must be >= 0"),
        ("agent.top_p=1.5", "agent.top_p must be 1, got 1.5"),
        ("agent.top_p=0.9", "a nucleus-sampled call trains nothing"),
        ("agent.temperature=0", "a greedy call is not a sample"),
        ("external.pin_temperature=0", "ExternalAgent.pin_temperature must be in (0, 2]"),
        ("cluster.placement=colocated", "trains on-policy (every cell rolls out, then every cell trains), so "
                                        "rl.staleness=1 cannot hold: set rl.staleness=0"),
        ("cluster.placement=sometimes", "cluster.placement: unknown mode 'sometimes'; allowed: async, colocated, elastic, lend"),
        ("cluster.rollout_workers=0", "cluster.rollout_workers must be >= 1"),
        ("cluster.trainer_workers=-1", "cluster.trainer_workers must be >= 0"),
        ("cluster.rollout_workers=1", "cluster: placement 'elastic' cannot move a cell on 2 cell(s): it keeps 1 rollout "
                                      "and 1 trainer cell(s); start at least 3 cells (e.g. cluster.rollout_workers=2) "
                                      "or use cluster.placement=async"),
        ("task.reply_padding=-5", "task.reply_padding must be >= 0, got -5"),
        ("sft.horizon=-1", "sft.horizon must be >= 0, got -1"),
        ("rl.max_update_kl=-0.1", "rl.max_update_kl must be >= 0, got -0.1"),
        ("rl.kl_probe_tokens=0", "rl.kl_probe_tokens must be > 0, got 0"),
        ("agent.max_context_tokens=4090", "agent.max_context_tokens 4090 + agent.max_tokens_per_call 24 = 4114 exceeds "
                                          "model.max_position_embeddings 4096"),
        ("cluster.engine_kv_tokens=1000", "cluster.engine_kv_tokens 1000 cannot hold one request of 2136 tokens"),
        ("model.num_heads=3", "model.hidden_size (128) must be a multiple of model.num_heads (3)"),
        ("model.colour=blue", "unknown field model.colour; allowed:"),
        ("rl=3", "rl must be a table of fields"),
        ("steps", "override 'steps' must look like section.field=value"),
    ],
)
def test_bad_values_get_one_line_errors(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_unsafe_off_policy_combinations_are_refused():
    with pytest.raises(ConfigError, match="correct only on-policy: set rl.staleness=0"):
        load_config(None, ["rl.loss=reinforce"])
    assert load_config(None, ["rl.loss=reinforce", "rl.staleness=0"]).rl.loss == "reinforce"
    with pytest.raises(ConfigError, match="rl.clip_ratio_c must be > 1"):
        load_config(None, ["rl.clip_ratio_c=0.5"])


def test_the_driver_side_loads_no_model_code():
    """The run configuration and the recipes only name the stages: transformers (seconds of CPU to
    import) stays out of the driver's process; the workers load it."""
    code = ("import sys, gyreflow.cli, gyreflow.config, gyreflow.recipes.grpo, gyreflow.recipes.replay; "
            "gyreflow.config.load_config(None, []); print(sorted(m for m in sys.modules if m.split('.')[0] == 'transformers'))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"
