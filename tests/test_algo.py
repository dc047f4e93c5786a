"""Advantage estimators, losses and their registries."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from gyreflow.algo import ADVANTAGES, LOSSES, GroupTree, Registry

# ---------------------------------------------------------------------------------- advantages

REWARDS = np.array([0.0, 1.0, 2.0, 5.0])
# mean = 8 / 4 = 2; deviations = [-2, -1, 0, 3]
# population variance = (4 + 1 + 0 + 9) / 4 = 3.5; std = sqrt(3.5) = 1.8708286933869707
# 1 / std = 0.5345224838248488
# grpo = [-2, -1, 0, 3] / std = [-1.0690449676496976, -0.5345224838248488, 0, 1.6035674514745464]
GRPO_GOLDEN = [-1.0690449676496976, -0.5345224838248488, 0.0, 1.6035674514745464]
# leave-one-out baselines = (8 - r) / 3 = [8/3, 7/3, 2, 1] -> rloo = [-8/3, -4/3, 0, 4]
RLOO_GOLDEN = [-8 / 3, -4 / 3, 0.0, 4.0]
DR_GRPO_GOLDEN = [-2.0, -1.0, 0.0, 3.0]


def per_execution(name: str, rewards, **kwargs) -> np.ndarray:
    """An estimator's advantages for executions that share no tokens: one node each."""
    adv = ADVANTAGES.get(name)(GroupTree.flat(np.asarray(rewards)), **kwargs)  # (G, G)
    assert np.all(adv[~np.eye(len(adv), dtype=bool)] == 0)  # nothing on the other executions' nodes
    return np.diag(adv)


def test_grpo_golden() -> None:
    adv = per_execution("grpo", REWARDS, eps=0.0)
    np.testing.assert_allclose(adv, GRPO_GOLDEN, rtol=1e-12, atol=1e-12)
    # eps only nudges the scale: (r - mean) / (std + 1e-6)
    np.testing.assert_allclose(per_execution("grpo", REWARDS), GRPO_GOLDEN, rtol=1e-6)


def test_grpo_binary_group() -> None:
    # rewards {0, 1, 1, 0}: mean 0.5, std 0.5 -> +-1
    adv = per_execution("grpo", np.array([0.0, 1.0, 1.0, 0.0]), eps=0.0)
    np.testing.assert_allclose(adv, [-1.0, 1.0, 1.0, -1.0])


def test_grpo_without_std_is_dr_grpo() -> None:
    adv = per_execution("grpo", REWARDS, scale_by_std=False)
    np.testing.assert_allclose(adv, DR_GRPO_GOLDEN)
    np.testing.assert_allclose(per_execution("dr_grpo", REWARDS), DR_GRPO_GOLDEN)


def test_rloo_golden() -> None:
    np.testing.assert_allclose(per_execution("rloo", REWARDS), RLOO_GOLDEN, rtol=1e-12)


def test_rloo_pair() -> None:
    # G = 2: each baseline is the other reward -> [0.25 - 0.75, 0.75 - 0.25]
    np.testing.assert_allclose(per_execution("rloo", np.array([0.25, 0.75])), [-0.5, 0.5])


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "tree"])
@pytest.mark.parametrize("rewards", [[0.7], [0.3, 0.3, 0.3], [1.0, 1.0], [0.1] * 7])
def test_no_signal_groups_give_zeros(name: str, rewards: list[float]) -> None:
    adv = per_execution(name, np.array(rewards))
    assert adv.shape == (len(rewards),)
    assert np.all(adv == 0.0)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "tree"])
def test_advantages_sum_to_zero(name: str) -> None:
    r = np.random.default_rng(0).random(9)
    adv = per_execution(name, r)
    assert adv.shape == (9,)
    assert abs(adv.sum()) < 1e-9


def test_tree_on_executions_that_share_nothing_is_twice_the_centred_reward() -> None:
    # Each execution alone on its node, under the root: global r - mean plus local r - mean.
    np.testing.assert_allclose(per_execution("tree", REWARDS), 2 * np.array(DR_GRPO_GOLDEN))


def test_tree_node_advantages_by_hand() -> None:
    """Node 0: the prompt (all three); node 1: a continuation e0 and e1 share; nodes 2, 3: where
    e0 and e1 part; node 4: e2's own continuation. Rewards 1, 0, 0.2 (mean 0.4)."""
    through = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=bool)
    group = GroupTree(np.array([1.0, 0.0, 0.2]), np.array([-1, 0, 1, 1, 0]), through)
    # V = [0.4, 0.5, 1, 0, 0.2]; A(k) = ((V(k) - 0.4) + (V(k) - V(parent))) / sqrt(executions at k)
    node = [0.0, (0.1 + 0.1) / np.sqrt(2), 0.6 + 0.5, -0.4 - 0.5, -0.2 - 0.2]
    np.testing.assert_allclose(ADVANTAGES.get("tree")(group), through * np.array(node)[:, None], atol=1e-12)
    # The group-relative estimators give each execution one advantage on every node it reached.
    np.testing.assert_allclose(ADVANTAGES.get("dr_grpo")(group), through * np.array([0.6, -0.4, -0.2]))


def test_group_tree_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="through must be"):
        GroupTree(np.zeros(2), np.array([-1]), np.ones((1, 3), bool))
    with pytest.raises(ValueError, match="earlier node"):
        GroupTree(np.zeros(1), np.array([-1, 1]), np.ones((2, 1), bool))


@pytest.mark.parametrize("bad", [np.zeros((2, 2)), np.array([0.0, np.nan])])
def test_advantages_reject_bad_rewards(bad: np.ndarray) -> None:
    with pytest.raises(ValueError):
        per_execution("grpo", bad)


# ---------------------------------------------------------------------------------------- loss

# Tokens (clip_eps = 0.2, so the ratio's flat region is outside [0.8, 1.2]):
#   t0: ratio 1.5, A = +1: min(1.5, 1.2)  =  1.2  clipped   -> per-token -1.2, no gradient
#   t1: ratio 0.5, A = +1: min(0.5, 0.8)  =  0.5  unclipped -> -0.5
#   t2: ratio 1.5, A = -1: min(-1.5, -1.2) = -1.5 unclipped -> +1.5
#   t3: ratio 0.5, A = -1: min(-0.5, -0.8) = -0.8 clipped   -> +0.8, no gradient
#   t4: ratio 1.1, A = +2: min(2.2, 2.2)  =  2.2  unclipped -> -2.2
#   t5: masked out (garbage log-prob -inf)
# loss = (-1.2 - 0.5 + 1.5 + 0.8 - 2.2) / 5 = -1.6 / 5 = -0.32
# d loss / d logp_i = -A_i * ratio_i / 5 on unclipped tokens: t1 -0.1, t2 +0.3, t4 -0.44
# clip_frac = 2 / 5; ratio_mean = 5.1 / 5 = 1.02; ratio_max = 1.5
# approx_kl = mean((r - 1) - ln r):
#   r=1.5: 0.5 - 0.4054651081 = 0.0945348919; r=0.5: -0.5 + 0.6931471806 = 0.1931471806
#   r=1.1: 0.1 - 0.0953101798 = 0.0046898202
#   (2 * 0.0945348919 + 2 * 0.1931471806 + 0.0046898202) / 5 = 0.1160107930
RATIOS = [1.5, 0.5, 1.5, 0.5, 1.1, 1.0]
OLD = [-1.0, -2.0, -0.5, -1.0, -3.0, 0.0]
ADV = [1.0, 1.0, -1.0, -1.0, 2.0, 5.0]
MASK = [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]


def _golden_inputs(dtype: torch.dtype = torch.float64):
    old = torch.tensor(OLD, dtype=dtype)
    logp = old + torch.tensor(RATIOS, dtype=dtype).log()
    logp[5] = -math.inf
    logp.requires_grad_(True)
    return logp, old, torch.tensor(ADV, dtype=dtype), torch.tensor(MASK, dtype=dtype)


def test_ppo_clip_golden_value_and_gradient() -> None:
    logp, old, adv, mask = _golden_inputs()
    loss, metrics = LOSSES.get("ppo_clip")(logp, old, adv, mask, clip_eps=0.2)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(-0.32, abs=1e-12)
    loss.backward()
    np.testing.assert_allclose(
        logp.grad.numpy(), [0.0, -0.1, 0.3, 0.0, -0.44, 0.0], rtol=1e-12, atol=1e-12
    )
    # clipped (t0, t3) and masked (t5) tokens get exactly zero gradient
    assert logp.grad[0].item() == 0.0 and logp.grad[3].item() == 0.0 and logp.grad[5].item() == 0.0
    assert metrics["clip_frac"] == pytest.approx(0.4)
    assert metrics["ratio_mean"] == pytest.approx(1.02)
    assert metrics["ratio_max"] == pytest.approx(1.5)
    assert metrics["approx_kl"] == pytest.approx(0.1160107930, abs=1e-9)
    assert metrics["n_tokens"] == 5.0
    assert all(isinstance(v, float) for v in metrics.values())


def test_ppo_clip_higher_unclips_t0() -> None:
    # clip_eps_high = 0.6: t0's ratio 1.5 < 1.6 so it is unclipped -> -1.5 instead of -1.2
    # loss = (-1.5 - 0.5 + 1.5 + 0.8 - 2.2) / 5 = -0.38; t0 gradient = -1 * 1.5 / 5 = -0.3
    logp, old, adv, mask = _golden_inputs()
    loss, metrics = LOSSES.get("ppo_clip")(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.6)
    assert loss.item() == pytest.approx(-0.38, abs=1e-12)
    loss.backward()
    assert logp.grad[0].item() == pytest.approx(-0.3)
    assert logp.grad[3].item() == 0.0  # t3 is still below 1 - 0.2
    assert metrics["clip_frac"] == pytest.approx(0.2)


def test_ppo_clip_loss_denominator() -> None:
    logp, old, adv, mask = _golden_inputs()
    loss, _ = LOSSES.get("ppo_clip")(logp, old, adv, mask, loss_denominator=10.0)
    assert loss.item() == pytest.approx(-1.6 / 10)


def test_ppo_clip_gradcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 32
    old = -torch.rand(n, generator=gen, dtype=torch.float64) * 3
    log_ratio = torch.randn(n, generator=gen, dtype=torch.float64) * 0.4
    ratio = log_ratio.exp()
    # keep away from the clip kinks, where the loss is not differentiable
    log_ratio = torch.where(
        ((ratio - 0.8).abs() < 1e-3) | ((ratio - 1.2).abs() < 1e-3), log_ratio + 0.01, log_ratio
    )
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = (torch.rand(n, generator=gen) > 0.25).double()
    logp = (old + log_ratio).requires_grad_(True)
    fn = LOSSES.get("ppo_clip")
    assert torch.autograd.gradcheck(lambda lp: fn(lp, old, adv, mask)[0], (logp,))


def test_on_policy_ppo_equals_reinforce_gradient() -> None:
    # at ratio 1 nothing is clipped and d(r * A)/d logp = A, the REINFORCE gradient
    logp = torch.tensor([-1.0, -2.0, -0.3], dtype=torch.float64, requires_grad=True)
    old = logp.detach().clone()
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    mask = torch.ones(3, dtype=torch.float64)
    LOSSES.get("ppo_clip")(logp, old, adv, mask)[0].backward()
    g_ppo = logp.grad.clone()
    logp.grad = None
    LOSSES.get("reinforce")(logp, old, adv, mask)[0].backward()
    torch.testing.assert_close(g_ppo, logp.grad)


def test_reinforce_golden() -> None:
    # -(1 * -1 + (-1) * -2) / 2 = -0.5; gradient -A / 2 = [-0.5, 0.5]; masked token ignored
    logp = torch.tensor([-1.0, -2.0, -math.inf], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-1.0, -2.0, 0.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 3.0], dtype=torch.float64)
    mask = torch.tensor([1.0, 1.0, 0.0], dtype=torch.float64)
    loss, metrics = LOSSES.get("reinforce")(logp, old, adv, mask, clip_eps=0.1)
    assert loss.item() == pytest.approx(-0.5)
    loss.backward()
    np.testing.assert_allclose(logp.grad.numpy(), [-0.5, 0.5, 0.0])
    assert metrics["clip_frac"] == 0.0
    assert metrics["ratio_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("name", ["ppo_clip", "reinforce"])
def test_empty_mask_gives_zero_loss(name: str) -> None:
    logp = torch.randn(4, requires_grad=True)
    loss, metrics = LOSSES.get(name)(logp, torch.zeros(4), torch.ones(4), torch.zeros(4))
    assert loss.item() == 0.0
    loss.backward()
    assert torch.all(logp.grad == 0)
    assert metrics["n_tokens"] == 0.0


def test_loss_rejects_shape_mismatch() -> None:
    with pytest.raises(ValueError, match=r"\(N,\)"):
        LOSSES.get("ppo_clip")(torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.ones(3))


# ------------------------------------------------------------------------------------ registry


def test_builtin_names() -> None:
    assert ADVANTAGES.names() == ["dr_grpo", "grpo", "rloo", "tree"]
    assert LOSSES.names() == ["ppo_clip", "reinforce"]


def test_unknown_name_lists_allowed() -> None:
    with pytest.raises(ValueError) as err:
        ADVANTAGES.get("gae")
    msg = str(err.value)
    assert "'gae'" in msg
    for name in ("grpo", "rloo", "dr_grpo"):
        assert repr(name) in msg
    with pytest.raises(ValueError, match="allowed: 'ppo_clip', 'reinforce'"):
        LOSSES.get("dpo")


def test_registry_register_and_duplicate() -> None:
    reg: Registry = Registry("thing")

    @reg.register("double")
    def double(x: int) -> int:
        return 2 * x

    assert reg.get("double") is double and reg.get("double")(3) == 6
    assert "double" in reg and reg.names() == ["double"]
    with pytest.raises(ValueError, match="already registered"):
        reg.register("double")(lambda x: x)
    assert reg.unregister("double") is double and "double" not in reg and reg.names() == []
    with pytest.raises(ValueError, match="no thing 'double' is registered"):
        reg.unregister("double")


def test_dual_clip_bounds_a_negative_advantage_with_a_large_ratio():
    """By hand: A = -1, ratio e^2 = 7.39. PPO's min picks r*A = -7.39, a loss of 7.39 growing with
    the ratio; the dual clip at c = 3 caps it at -c*A = 3, with no gradient."""
    lp = torch.tensor([0.0, 0.0], requires_grad=True)
    old = torch.tensor([-2.0, -2.0])
    adv = torch.tensor([-1.0, 1.0])
    mask = torch.tensor([1.0, 0.0])
    plain, _ = LOSSES.get("ppo_clip")(lp, old, adv, mask, clip_eps=0.2)
    assert float(plain.detach()) == pytest.approx(math.exp(2.0), rel=1e-6)
    dual, _ = LOSSES.get("ppo_clip")(lp, old, adv, mask, clip_eps=0.2, clip_ratio_c=3.0)
    assert float(dual.detach()) == pytest.approx(3.0)
    dual.backward()
    assert lp.grad.abs().max() == 0
    # a positive advantage is left alone: clipped at 1 + eps as before
    pos, _ = LOSSES.get("ppo_clip")(lp.detach(), old, -adv, mask, clip_eps=0.2, clip_ratio_c=3.0)
    assert float(pos) == pytest.approx(-1.2)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        LOSSES.get("ppo_clip")(lp, old, adv, mask, clip_ratio_c=1.0)
