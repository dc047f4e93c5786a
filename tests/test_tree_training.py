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
    assert got["tokens"] == ref["tokens"] == tree.n_samples
    assert got["oldest"] == ref["oldest"]
    for k, v in ref["sums"].items():
        assert got["sums"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    if loss == "ppo_clip":
        # token-summed: the count of clipped samples
        assert 0 < ref["sums"]["clip_frac"] < ref["tokens"], "the case should clip some samples and not others"
    for name, g in ref["grads"].items():
        assert np.abs(g).max() > 0 or name.endswith("bias")
        np.testing.assert_allclose(got["grads"][name], g, rtol=1e-4, atol=1e-6, err_msg=name)


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
