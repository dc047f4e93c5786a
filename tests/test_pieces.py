"""A path longer than a micro-batch trains in pieces with the gradient of the whole path."""

import numpy as np
import pytest
import torch

import gyreflow.train.attention as attention
from gyreflow.model.policy import ModelConfig, build_policy
from gyreflow.train.packing import PathSample, pack
from gyreflow.train.pieces import backward_in_pieces
from gyreflow.train.trainer import OptimConfig, Trainer

# Two layers (a piece's keys and values feed the next layer), grouped-query attention.
CFG = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    pass


def chain(L: int, seed: int, version: int = 0) -> PathSample:
    rng = np.random.default_rng(seed)
    trained = rng.random(L) < 0.4
    trained[0] = False
    return PathSample(rng.integers(0, 256, L).astype(np.int32), trained,
                      np.where(trained, rng.normal(-4, 0.5, L), 0).astype(np.float32),
                      np.full(L, version, np.int32), float(rng.normal()), rng.uniform(0.7, 1.2, L).astype(np.float32))


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("size, mask_bytes", [(64, 1 << 25), (97, 1 << 25), (64, 4096)])
def test_pieces_give_the_gradient_of_the_whole_path(monkeypatch, size, mask_bytes):
    """Pieces of 64 or 97 tokens (the last one shorter), and queries cut further so that no
    attention mask over 4 KB is built: the gradient of every parameter is that of one forward."""
    monkeypatch.setattr(attention, "MASK_BYTES", mask_bytes)
    sample = chain(300, 1)
    (mb,) = pack([sample], 10_000)
    model = build_policy(CFG, seed=2)

    def loss_of(m):
        from gyreflow.train.trainer import sample_logprobs

        lp = sample_logprobs(model, m)  # (N,)
        return ((lp - m.old_logprobs).exp() * m.advantages * m.weights).sum() / m.weights.sum(), {"lp": lp.detach().mean()}

    loss, metrics = loss_of(mb)
    (loss * 0.5).backward()
    whole = grads(model)
    model.zero_grad(set_to_none=True)
    got = backward_in_pieces(model, mb, size, loss_of, denom=2 * float(mb.weights.sum()))
    for name, g in grads(model).items():
        torch.testing.assert_close(g, whole[name], rtol=1e-4, atol=1e-6, msg=name)
    assert got["lp"] == pytest.approx(float(metrics["lp"]) * 0.5, rel=1e-5)


def test_the_trainer_trains_a_long_path_in_pieces_as_it_would_whole():
    """A step with a path of 700 tokens among short ones: micro-batches of 128 tokens (the long path
    in pieces) give the same gradient and metrics as micro-batches that hold it whole."""
    data = [chain(700, 3), chain(40, 4), chain(90, 5)]
    out = {}
    for tokens in (128, 4096):
        t = Trainer(build_policy(CFG, seed=6), OptimConfig(micro_batch_tokens=tokens))
        out[tokens] = t.gradients(data, "reinforce")  # no clipping: every token has a gradient
    small, big = out[128], out[4096]
    assert small.tokens == big.tokens == sum(s.n_trained for s in data)
    for name, g in big.grads.items():
        np.testing.assert_allclose(small.grads[name], g, rtol=1e-4, atol=1e-5, err_msg=name)
    # Token means add up over pieces as over micro-batches (a maximum or a count does not).
    for k in ("approx_kl", "ratio_mean"):
        assert small.sums[k] == pytest.approx(big.sums[k], rel=1e-4, abs=1e-7), k


def test_bench_pieces_reports_both_arms_and_their_ratios():
    from gyreflow.bench import pieces

    out = pieces.run(tokens=160, piece=48, repeats=1)
    assert len(out["whole"]) == len(out["pieces"]) == 1
    w, p = out["whole"][0], out["pieces"][0]
    assert out["long_path_peak_memory_ratio"]["runs"] == [w["peak_bytes"] / p["peak_bytes"]]
    assert out["long_path_time_ratio"]["runs"] == [p["seconds"] / w["seconds"]]
    assert out["grad_norm_rel_diff"] < 1e-4 and w["grad_norm"] > 0  # the same gradient, in other processes
    assert "long_path_peak_memory_ratio" in pieces.summary(out)
