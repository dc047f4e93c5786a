"""Training an execution's tree gives the loss and gradient of training every call on its own.

The reference is a second implementation: each call is its own sequence (prompt, then its
completion trained with the call's own log-probs and versions), with no tree at all. Every crafted
case has tokens that several calls sampled at the same context.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gyreflow.model.policy import ModelConfig, build_policy
from gyreflow.train.packing import PathSample
from gyreflow.train.trainer import OptimConfig, Trainer
from gyreflow.trajectory.records import CallRecord, ExecutionResult
from gyreflow.trajectory.tree import build_tree


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    pass


RNG = np.random.default_rng(7)
SYSTEM = [11, 12, 13, 14]


def call(i: int, prompt: list[int], completion: list[int], role: str = "main") -> CallRecord:
    c = len(completion)
    # Behaviour log-probs far enough from the policy's for PPO's clip to bite on some tokens.
    return CallRecord("e", i, f"c{i}", role, np.array(prompt), np.array(completion),
                      RNG.normal(-5.5, 1.0, c).astype(np.float32), np.full(c, i % 3, np.int32))


def seq(c: CallRecord) -> list[int]:
    return [*c.prompt_ids.tolist(), *c.completion_ids.tolist()]


def chain() -> list[CallRecord]:
    c0 = call(0, SYSTEM, [20, 21, 22])
    c1 = call(1, seq(c0) + [30], [23, 24])
    return [c0, c1, call(2, seq(c1) + [31], [25, 26, 27])]


def compaction_loop() -> list[CallRecord]:
    """Compaction back to the same summary, then the same wrong call again and again."""
    calls, ctx = [], SYSTEM + [40]
    for i in range(6):
        calls.append(call(i, ctx, [50, 51, 52]))
        ctx = ctx + [50, 51, 52, 41] if i % 2 == 0 else SYSTEM + [40]
    return calls


def best_of_n() -> list[CallRecord]:
    p = SYSTEM + [60]
    return [call(0, p, [61, 62, 63]), call(1, p, [61, 62, 63]), call(2, p, [61, 62, 64]), call(3, p, [61, 65])]


def sub_agents() -> list[CallRecord]:
    main = call(0, SYSTEM, [70, 71])
    task = seq(main) + [72]
    subs = [call(1 + k, task, [73, 74, 75], role="sub-agent") for k in range(3)]
    summary = call(4, seq(subs[0]) + [76], [77, 78], role="sub-agent-summary")
    return [main, *subs, summary, call(5, seq(main) + [79, 77, 78], [80])]


def retries() -> list[CallRecord]:
    c0, c1, c2 = chain()
    again = call(3, c1.prompt_ids.tolist(), c1.completion_ids.tolist())  # the same call resent and resampled
    return [c0, c1, again, c2, call(4, c2.prompt_ids.tolist(), c2.completion_ids.tolist()[:2])]


CASES = {"chain": chain, "compaction_loop": compaction_loop, "best_of_n": best_of_n, "sub_agents": sub_agents,
         "retries": retries}


def per_call(calls: list[CallRecord], adv: float) -> list[PathSample]:
    out = []
    for c in calls:
        p, n = len(c.prompt_ids), len(c.completion_ids)
        trained = np.r_[np.zeros(p, bool), np.ones(n, bool)]
        out.append(PathSample(np.array(seq(c), np.int32), trained, np.r_[np.zeros(p, np.float32), c.logprobs],
                              np.r_[np.full(p, -1, np.int32), c.versions], adv))
    return out


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("loss", ["ppo_clip", "reinforce"])
def test_tree_equals_every_call_on_its_own(case, loss):
    calls = CASES[case]()
    tree = build_tree(ExecutionResult("e", "t", 0, 0, "train", calls, 0.5, False, "done"))
    assert tree.n_samples == sum(len(c.completion_ids) for c in calls)
    # every case but the plain chain samples some token more than once
    assert (tree.n_samples > int(tree.sampled.sum())) == (case != "chain")
    trainer = Trainer(build_policy(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                               num_kv_heads=2), seed=3), OptimConfig(), version=2)
    kw = {"clip_eps": 0.2} if loss == "ppo_clip" else {}
    got = trainer.gradients([PathSample.of(p, 0.7) for p in tree.paths()], loss, **kw)
    ref = trainer.gradients(per_call(calls, 0.7), loss, **kw)
    assert got.tokens == ref.tokens == tree.n_samples
    assert got.oldest == ref.oldest
    for k, v in ref.sums.items():
        assert got.sums[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    if loss == "ppo_clip":
        # token-summed: the count of clipped samples
        assert 0 < ref.sums["clip_frac"] < ref.tokens, "the case should clip some samples and not others"
    for name, g in ref.grads.items():
        assert np.abs(g).max() > 0 or name.endswith("bias")
        np.testing.assert_allclose(got.grads[name], g, rtol=1e-4, atol=1e-6, err_msg=name)


def test_sft_counts_repeated_samples():
    calls = best_of_n()
    tree = build_tree(ExecutionResult("e", "t", 0, 0, "train", calls, 1.0, True, "done"))
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
    a = Trainer(build_policy(cfg, seed=3), OptimConfig(lr=1e-2))
    b = Trainer(build_policy(cfg, seed=3), OptimConfig(lr=1e-2))
    got = a.sft_step([PathSample.of(p, 0.0) for p in tree.paths()])
    ref = b.sft_step(per_call(calls, 0.0))
    assert got["trained_tokens"] == ref["trained_tokens"] == 11
    assert got["nll"] == pytest.approx(ref["nll"], rel=1e-5)
    # Adam's first step divides by |g|: compare the gradients each step applied, not the weights.
    for (name, x), y in zip(a.model.named_parameters(), b.model.parameters()):
        torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------ sampling settings


def engine_call(engine, i: int, prompt: list[int], temperature: float, top_p: float = 1.0) -> CallRecord:
    from gyreflow.engine.base import GenerationRequest, SamplingParams

    fut = engine.submit(GenerationRequest(f"e/{i}", np.array(prompt, np.int32),
                                          SamplingParams(temperature=temperature, top_p=top_p, max_tokens=12, seed=i)))
    while not fut.done():
        engine.step()
    out = fut.result()
    return CallRecord("e", i, f"e/{i}", "main", out.prompt_ids, out.completion_ids, out.logprobs, out.versions,
                      temperature=temperature, top_p=top_p)


def test_on_policy_samples_at_their_own_temperature_have_ratio_one():
    """Calls drawn at several temperatures, recomputed by the trainer at the same weights: every
    importance ratio is 1 (the trainer scores each call at its own temperature)."""
    from gyreflow.engine.torch_engine import TorchEngine

    model = build_policy(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                     num_kv_heads=2), seed=5)
    engine = TorchEngine(model, device="cpu", max_seq_len=256)
    calls = [engine_call(engine, 0, SYSTEM, 0.5)]
    calls.append(engine_call(engine, 1, seq(calls[0]) + [30], 1.5))
    calls.append(engine_call(engine, 2, seq(calls[0]) + [30], 1.0))
    tree = build_tree(ExecutionResult("e", "t", 0, 0, "train", calls, 0.5, False, "done"))
    assert sorted(set(tree.temperatures[tree.sampled].tolist())) == [0.5, 1.0, 1.5]
    trainer = Trainer(model, OptimConfig(), version=0)
    out = trainer.gradients([PathSample.of(p, 1.0) for p in tree.paths()], "ppo_clip", clip_eps=0.2)
    n = out.tokens
    assert n == tree.n_samples == 36
    assert out.sums["ratio_mean"] / n == pytest.approx(1.0, abs=1e-4)
    assert out.sums["approx_kl"] / n == pytest.approx(0.0, abs=1e-6)
    # Scored at temperature 1 throughout (what the trainer did before), the ratios are not 1.
    flat = [PathSample(p.tokens, p.loss_mask, p.logprobs, p.versions, 1.0, extra_pos=p.extra_pos,
                       extra_logprobs=p.extra_logprobs, extra_versions=p.extra_versions) for p in tree.paths()]
    assert trainer.gradients(flat, "ppo_clip", clip_eps=0.2).sums["approx_kl"] / n > 1e-3


def test_greedy_and_nucleus_calls_are_context_not_samples():
    c0 = call(0, SYSTEM, [20, 21, 22])
    greedy = CallRecord("e", 1, "c1", "main", np.array(seq(c0) + [30]), np.array([23, 24]),
                        np.array([-0.1, -0.2], np.float32), np.array([1, 1], np.int32), temperature=0.0)
    nucleus = CallRecord("e", 2, "c2", "main", np.array(seq(greedy) + [31]), np.array([25]),
                         np.array([-0.3], np.float32), np.array([1], np.int32), top_p=0.9)
    tree = build_tree(ExecutionResult("e", "t", 0, 0, "train", [c0, greedy, nucleus], 0.5, False, "done"))
    (path,) = tree.paths()
    assert path.tokens.tolist() == seq(nucleus)
    assert np.flatnonzero(path.loss_mask).tolist() == [4, 5, 6]  # c0's completion only
    assert tree.n_samples == 3
    # The same tokens sampled by a trainable call at the same context are samples again.
    again = CallRecord("e", 3, "c3", "main", greedy.prompt_ids, greedy.completion_ids,
                       np.array([-1.1, -1.2], np.float32), np.array([2, 2], np.int32), temperature=0.8)
    tree = build_tree(ExecutionResult("e", "t", 0, 0, "train", [c0, greedy, nucleus, again], 0.5, False, "done"))
    (path,) = tree.paths()
    assert np.flatnonzero(path.loss_mask).tolist() == [4, 5, 6, 8, 9]
    assert path.logprobs[[8, 9]].tolist() == pytest.approx([-1.1, -1.2]) and path.temperatures[[8, 9]].tolist() == \
        pytest.approx([0.8, 0.8])


# ------------------------------------------------------------------------------- aggregation


def test_aggregation_weights_by_hand():
    from gyreflow.algo import AGGREGATIONS

    np.testing.assert_allclose(AGGREGATIONS.get("execution_mean")(np.array([8, 11, 0, 4])), [1 / 8, 1 / 11, 0, 1 / 4])
    np.testing.assert_allclose(AGGREGATIONS.get("token_mean")(np.array([8, 11, 0, 4])), [1, 1, 1, 1])


def test_two_level_averaging_is_the_mean_over_executions_of_their_token_means():
    from gyreflow.stages import group_advantages

    trees = [build_tree(ExecutionResult(f"e{i}", "t", 0, i, "train", make(), r, False, "done"))
             for i, (make, r) in enumerate([(chain, 1.0), (best_of_n, 0.0), (sub_agents, 0.5)])]
    assert [t.n_samples for t in trees] == [8, 11, 14]
    trainer = Trainer(build_policy(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                               num_kv_heads=2), seed=3), OptimConfig(), version=2)
    group = group_advantages(trees, "grpo", 0, "execution_mean", 0)
    got = trainer.gradients(group.samples, "ppo_clip", clip_eps=0.2)
    assert got.tokens == 33 and got.weight == pytest.approx(3.0)
    # The reference: each execution's own token-mean gradient, then their plain mean.
    per = []
    for t, a in zip(trees, group.advantages):
        r = trainer.gradients([PathSample.of(p, a) for p in t.paths()], "ppo_clip", clip_eps=0.2)
        per.append({k: g / r.tokens for k, g in r.grads.items()})
    for name, g in got.grads.items():
        np.testing.assert_allclose(g / got.weight, np.mean([p[name] for p in per], axis=0), rtol=1e-4, atol=1e-7,
                                   err_msg=name)
    # token_mean weighs every sample alike: the 14-sample execution counts 14/33, not 1/3.
    flat = trainer.gradients(group_advantages(trees, "grpo", 0, "token_mean", 0).samples, "ppo_clip", clip_eps=0.2)
    assert flat.weight == pytest.approx(33.0)


def test_j_max_bounds_the_paths_of_each_execution():
    from gyreflow.stages import group_advantages

    trees = [build_tree(ExecutionResult(f"e{i}", "t", 0, i, "train", best_of_n(), 0.1 * i, False, "done"))
             for i in range(3)]
    assert all(t.n_leaves == 3 for t in trees)
    one = group_advantages(trees, "grpo", 1, "execution_mean", 0)
    assert len(one.samples) == 3  # one path per execution
    assert [s.weight for s in one.samples] == pytest.approx([1 / s.n_trained for s in one.samples])
    again = group_advantages(trees, "grpo", 1, "execution_mean", 0).samples
    assert [s.tokens.tolist() for s in again] == [s.tokens.tolist() for s in one.samples]  # seeded
    every = group_advantages(trees, "grpo", 0, "execution_mean", 0)
    assert len(every.samples) == 9 and sum(s.n_trained for s in every.samples) == 3 * 11


def test_a_dropped_execution_leaves_its_group_s_advantages_as_if_it_were_not_there():
    from gyreflow.algo import ADVANTAGES, GroupTree
    from gyreflow.stages import group_advantages

    results = [ExecutionResult("e0", "t", 0, 0, "train", chain(), 1.0, True, "done"),
               ExecutionResult("e1", "t", 0, 1, "train", chain(), 0.25, False, "policy_crash"),
               ExecutionResult("e2", "t", 0, 2, "train", [], 0.0, False, "infra_failure"),
               ExecutionResult("e3", "t", 0, 3, "train", chain(), 0.0, False, "budget")]
    trees = [build_tree(r) for r in results]
    assert [t.dropped for t in trees] == [False, False, True, False]
    group = group_advantages(trees, "grpo", 0, "execution_mean", 0)
    without = np.diag(ADVANTAGES.get("grpo")(GroupTree.flat(np.array([1.0, 0.25, 0.0]))))
    # by hand: mean 5/12, population std of (1, 1/4, 0)
    mean, std = 5 / 12, np.sqrt(((1 - 5 / 12) ** 2 + (0.25 - 5 / 12) ** 2 + (5 / 12) ** 2) / 3)
    np.testing.assert_allclose(without, [(1 - mean) / std, (0.25 - mean) / std, -mean / std], rtol=1e-5)
    np.testing.assert_allclose(group.advantages, [without[0], without[1], 0.0, without[2]])
    assert len(group.samples) == 3  # the placeholder trains nothing


def test_a_group_without_advantage_signal_trains_nothing():
    from gyreflow.stages import group_advantages

    trees = [build_tree(ExecutionResult(f"e{i}", "t", 0, i, "train", chain(), 0.5, False, "done")) for i in range(4)]
    group = group_advantages(trees, "grpo", 0, "execution_mean", 0)
    assert group.samples == [] and group.advantages == [0.0] * 4


def test_records_that_contradict_each_other_are_excluded_not_crashed_on(caplog):
    from gyreflow.stages import make_tree

    good = chain()
    assert make_tree(ExecutionResult("ok", "t", 0, 0, "train", good, 1.0, True, "done"), 300, 64).n_samples == 8
    cases = {
        "outside the vocabulary": [good[0], call(1, seq(good[0]), [23, 400])],
        "more than the model's 64 positions": [good[0], call(1, seq(good[0]) + [5] * 60, [23])],
        "goes backwards within the call": [CallRecord("e", 0, "c0", "main", np.array(SYSTEM), np.array([20, 21]),
                                                      np.zeros(2, np.float32), np.array([3, 2], np.int32))],
        "version 0 after 2 in an earlier call": [
            CallRecord("e", 0, "c0", "main", np.array(SYSTEM), np.array([20]), np.zeros(1, np.float32),
                       np.array([2], np.int32)),
            CallRecord("e", 1, "c1", "main", np.array(SYSTEM + [20, 30]), np.array([21]), np.zeros(1, np.float32),
                       np.array([0], np.int32))],
    }
    for what, calls in cases.items():
        with caplog.at_level("WARNING", logger="gyreflow"):
            tree = make_tree(ExecutionResult(f"bad-{len(what)}", "t", 0, 0, "train", calls, 1.0, True, "done"), 300, 64)
        assert tree.dropped and tree.n_samples == 0, what
        assert f"bad-{len(what)}" in caplog.text and what in caplog.text


# ------------------------------------------------------------------------------ tree-shared compute


@pytest.mark.parametrize("case", sorted(CASES))
def test_tree_packed_training_equals_per_path_training(case):
    """Each execution's paths packed as one tree (every node forwarded once, attention to ancestors
    only, positions by depth) give the gradient of training the paths one by one."""
    calls = CASES[case]()
    tree = build_tree(ExecutionResult("e", "t", 0, 0, "train", calls, 0.5, False, "done"))
    trainer = Trainer(build_policy(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                                               num_kv_heads=1), seed=4), OptimConfig(), version=2)
    for leaves in (None, tree.sample_paths(2, seed=1)):
        paths = tree.paths(leaves)
        per_path = trainer.gradients([PathSample.of(p, -0.6) for p in paths], "ppo_clip", clip_eps=0.2)
        packed = PathSample.of_tree(tree, leaves if leaves is not None else range(tree.n_leaves), -0.6)
        assert len(packed.tokens) <= sum(len(p) for p in paths)
        assert packed.n_trained == sum(p.n_trained for p in paths)
        got = trainer.gradients([packed], "ppo_clip", clip_eps=0.2)
        assert got.tokens == per_path.tokens
        for k, v in per_path.sums.items():
            assert got.sums[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
        for name, g in per_path.grads.items():
            np.testing.assert_allclose(got.grads[name], g, rtol=1e-4, atol=1e-5, err_msg=name)
    if tree.n_leaves > 1:
        assert len(PathSample.of_tree(tree, range(tree.n_leaves), 0.0).tokens) < sum(len(p) for p in tree.paths())


def test_group_advantages_packs_each_execution_as_one_tree():
    from gyreflow.stages import group_advantages

    trees = [build_tree(ExecutionResult(f"e{i}", "t", 0, i, "train", make(), r, False, "done"))
             for i, (make, r) in enumerate([(chain, 1.0), (best_of_n, 0.0), (sub_agents, 0.5)])]
    per_path = group_advantages(trees, "grpo", 0, "execution_mean", 0, tree_training=False)
    packed = group_advantages(trees, "grpo", 0, "execution_mean", 0, tree_training=True)
    assert len(per_path.samples) == sum(t.n_leaves for t in trees) > len(packed.samples) == 3
    assert [s.is_tree for s in packed.samples] == [False, True, True]  # a single chain stays a chain
    trainer = Trainer(build_policy(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                               num_kv_heads=2), seed=3), OptimConfig(), version=2)
    a = trainer.gradients(per_path.samples, "ppo_clip", clip_eps=0.2)
    b = trainer.gradients(packed.samples, "ppo_clip", clip_eps=0.2)
    assert a.tokens == b.tokens and a.weight == pytest.approx(b.weight)
    for name, g in a.grads.items():
        np.testing.assert_allclose(b.grads[name], g, rtol=1e-4, atol=1e-6, err_msg=name)


# ------------------------------------------------------------------------------ node advantages


def test_tree_estimator_credits_the_node_where_executions_part():
    """e0 and e1 sample the same first two tokens, then part; e2 goes its own way. Rewards 1, 0,
    0.2 (mean 0.4). Group tree: the prompt (all three), [91, 92] (e0, e1), then one node each."""
    from gyreflow.stages import group_advantages
    from gyreflow.trajectory.group import group_tree

    prompt = SYSTEM + [90]
    completions, rewards = [[91, 92, 93, 94], [91, 92, 95, 96], [97, 98]], [1.0, 0.0, 0.2]
    trees = [build_tree(ExecutionResult(f"e{i}", "t", 0, i, "train", [call(0, prompt, c)], r, False, "done"))
             for i, (c, r) in enumerate(zip(completions, rewards))]
    group, token_nodes = group_tree(trees)
    assert group.through.sum(axis=1).tolist() == [3, 2, 1, 1, 1]
    assert token_nodes[0].tolist() == [0] * 5 + [1, 1, 2, 2] and token_nodes[2].tolist() == [0] * 5 + [4, 4]
    out = group_advantages(trees, "tree", 0, "token_mean", 0)
    shared, e0, e1, e2 = 0.2 / np.sqrt(2), 0.6 + 0.5, -0.4 - 0.5, -0.2 - 0.2  # by hand, see test_algo
    got = [np.asarray(s.advantage).tolist() for s in out.samples]
    np.testing.assert_allclose(got[0], [0] * 5 + [shared] * 2 + [e0] * 2, atol=1e-6)
    np.testing.assert_allclose(got[1], [0] * 5 + [shared] * 2 + [e1] * 2, atol=1e-6)
    np.testing.assert_allclose(got[2], [0] * 5 + [e2] * 2, atol=1e-6)
    np.testing.assert_allclose(out.advantages, [(shared + e0) / 2, (shared + e1) / 2, e2], atol=1e-6)
    # A per-token advantage trains each token with its own: equal advantages give the scalar's gradient.
    trainer = Trainer(build_policy(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                               num_kv_heads=2), seed=3), OptimConfig(), version=2)
    path = trees[0].paths()[0]
    a = trainer.gradients([PathSample.of(path, 0.7)], "ppo_clip", clip_eps=0.2)
    b = trainer.gradients([PathSample.of(path, np.full(len(path), 0.7))], "ppo_clip", clip_eps=0.2)
    for name, g in a.grads.items():
        np.testing.assert_allclose(b.grads[name], g, rtol=1e-6, atol=1e-8, err_msg=name)


def test_tree_estimator_packs_per_token_advantages_into_tree_samples():
    """With tree training, the per-token advantages follow the tokens into the packed tree: the
    gradient equals training the same paths one by one with their own advantages."""
    from gyreflow.stages import group_advantages

    trees = [build_tree(ExecutionResult(f"e{i}", "t", 0, i, "train", make(), r, False, "done"))
             for i, (make, r) in enumerate([(best_of_n, 1.0), (sub_agents, 0.0), (retries, 0.2)])]
    trainer = Trainer(build_policy(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                                               num_kv_heads=2), seed=3), OptimConfig(), version=2)
    per_path = group_advantages(trees, "tree", 0, "token_mean", 0, tree_training=False).samples
    packed = group_advantages(trees, "tree", 0, "token_mean", 0, tree_training=True).samples
    assert len(packed) < len(per_path) and any(np.ndim(s.advantage) == 1 for s in packed)
    a = trainer.gradients(per_path, "ppo_clip", clip_eps=0.2)
    b = trainer.gradients(packed, "ppo_clip", clip_eps=0.2)
    assert a.tokens == b.tokens
    for name, g in a.grads.items():
        np.testing.assert_allclose(b.grads[name], g, rtol=1e-4, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_relative_estimators_give_the_same_on_the_group_tree_as_on_a_flat_one(estimator):
    """They are handed a flat tree (one node per execution); on the real group tree they give each
    token of an execution the same advantage."""
    from gyreflow.algo import ADVANTAGES, GroupTree
    from gyreflow.trajectory.group import group_tree

    trees = [build_tree(ExecutionResult(f"e{i}", "t", 0, i, "train", make(), r, False, "done"))
             for i, (make, r) in enumerate([(best_of_n, 1.0), (sub_agents, 0.0), (retries, 0.2), (chain, 0.7)])]
    group, token_nodes = group_tree(trees)
    on_tree = ADVANTAGES.get(estimator)(group)  # (K, G)
    flat = np.diag(ADVANTAGES.get(estimator)(GroupTree.flat(group.rewards)))  # (G,)
    for g, nodes in enumerate(token_nodes):
        np.testing.assert_allclose(on_tree[nodes, g], flat[g], rtol=1e-12)
