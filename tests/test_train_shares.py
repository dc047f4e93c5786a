"""A step's gradient work split into shares gives the very update of training it at once."""

import numpy as np
import pytest
import torch

from gyreflow.model.policy import ModelConfig, build_policy
from gyreflow.stages import partition
from gyreflow.train.packing import PathSample, probe_of
from gyreflow.train.trainer import GradientShare, OptimConfig, Trainer


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    pass


def samples(n: int, seed: int) -> list[PathSample]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        L = int(rng.integers(6, 40))
        trained = np.zeros(L, bool)
        trained[L // 2:] = True
        out.append(PathSample(rng.integers(0, 256, L).astype(np.int32), trained,
                              np.where(trained, rng.normal(-3, 0.5, L), 0).astype(np.float32),
                              np.where(trained, 3, -1).astype(np.int32), float(rng.normal())))
    return out


def test_partition_is_balanced_and_complete():
    sizes = [50, 10, 40, 30, 20, 5, 5]
    bins = partition(sizes, 3)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in b) for b in bins]
    assert max(loads) - min(loads) <= 10
    assert partition(sizes, 3) == bins  # deterministic
    assert partition([7], 3) == [[0], [], []]


@pytest.mark.parametrize("parts", [1, 3])
def test_shares_then_update_equals_one_step(parts):
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
    data = samples(7, 0)
    whole = Trainer(build_policy(cfg, seed=1), OptimConfig(lr=1e-2), version=3)
    split = Trainer(build_policy(cfg, seed=1), OptimConfig(lr=1e-2), version=3)
    ref = whole.rl_step(data, "ppo_clip", clip_eps=0.2)
    bins = partition([int(s.trained.sum()) for s in data], parts)
    before = [p.detach().clone() for p in split.model.parameters()]
    shares = [split.gradients([data[i] for i in b], "ppo_clip", clip_eps=0.2) for b in bins]
    # Computing shares leaves the replica and its version untouched.
    assert split.version == 3 and all(torch.equal(a, p) for a, p in zip(before, split.model.parameters()))
    got = split.apply_gradients(shares)
    assert got["version"] == ref["version"] == 4 and got["trained_tokens"] == ref["trained_tokens"]
    assert got["max_staleness"] == ref["max_staleness"] == 0
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    for k in ("clip_frac", "approx_kl"):
        if k in ref:
            assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7)
    # The (clipped) gradient each update applied is the same; Adam's first step divides by |g|,
    # so weights are compared through the gradients rather than element by element.
    for (name, a), b in zip(whole.model.named_parameters(), split.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_share_at_another_version_is_refused():
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
    t = Trainer(build_policy(cfg, seed=1), OptimConfig(), version=2)
    share = t.gradients(samples(2, 1), "reinforce")
    t.version = 3
    with pytest.raises(ValueError, match="computed at version 2, the trainer is at 3"):
        t.apply_gradients([share])


def test_a_step_with_nothing_to_train_still_advances_the_version():
    """Every advantage zero: the weights stay, the version counts the step (pipelines key their
    evaluations and publications by version)."""
    import torch

    from gyreflow.model import ModelConfig, build_policy
    from gyreflow.train.trainer import OptimConfig, Trainer

    model = build_policy(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2))
    trainer = Trainer(model, OptimConfig(), version=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = trainer.apply_gradients([GradientShare({}, 0, 0.0, {}, None, 0, 0, version=3)])
    assert out["version"] == trainer.version == 4 and out["trained_tokens"] == 0
    assert trainer.rl_step([])["version"] == 5
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_rl_learning_rate_warms_up_over_the_first_updates():
    """Adam's first update moves every parameter with a gradient by the full learning rate
    (m/sqrt(v) = g/|g|, bias-corrected), so the warm-up must show in the weights: lr/3, then 2*lr/3, then lr."""
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
    lr = 1e-2
    t = Trainer(build_policy(cfg, seed=1), OptimConfig(lr=lr, warmup_steps=3, grad_clip=1e9), version=0)
    got = []
    for k in range(4):
        before = [p.detach().clone() for p in t.model.parameters()]
        got.append(t.apply_gradients([t.gradients(samples(5, 10 + k), "reinforce")])["lr"])
        if k == 0:
            step = torch.cat([(p.detach() - b).abs().flatten() for p, b in zip(t.model.parameters(), before)])
            moved = step[step > 0]
            assert moved.numel() > 0
            # (a gradient within Adam's eps of zero moves its weight less)
            assert moved.max() <= lr / 3 * (1 + 1e-3)
            assert ((moved - lr / 3).abs() <= lr / 3 * 1e-3).float().mean() > 0.95
    assert got == pytest.approx([lr / 3, 2 * lr / 3, lr, lr])
    # No warm-up: the first update is already at the full rate.
    t0 = Trainer(build_policy(cfg, seed=1), OptimConfig(lr=lr, warmup_steps=0), version=0)
    assert t0.rl_step(samples(5, 20), "reinforce")["lr"] == pytest.approx(lr)


def k3_kl(before, after, data: list[PathSample]) -> float:
    """Mean KL(before || after) over the trained tokens of ``data`` (chains at temperature 1), by
    the k3 estimator, from plain forwards of the two models."""
    num, n = 0.0, 0
    with torch.no_grad():
        for s in data:
            ids = torch.as_tensor(s.tokens, dtype=torch.long)[None]  # (1, L)
            pos = np.flatnonzero(s.trained)
            tgt = torch.as_tensor(s.tokens[pos], dtype=torch.long)
            lp = [torch.log_softmax(m(input_ids=ids).logits[0].float(), -1)[pos - 1, tgt] for m in (before, after)]
            d = lp[1] - lp[0]  # (T,)
            num += float((torch.exp(d) - 1 - d).sum())
            n += len(pos)
    return num / n


def model_at(cfg, weights: list[torch.Tensor]):
    m = build_policy(cfg, seed=0)
    with torch.no_grad():
        for p, w in zip(m.parameters(), weights):
            p.copy_(w)
    return m.eval()


def test_an_update_is_cut_to_its_kl_bound():
    """The bounded update lies on the segment from the old weights to the whole Adam step, at the
    largest halving whose KL on the probe is within the bound (twice that step breaks it)."""
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
    data = samples(6, 4)
    optim = OptimConfig(lr=0.05, warmup_steps=0)
    whole = Trainer(build_policy(cfg, seed=1), optim)
    cut = Trainer(build_policy(cfg, seed=1), optim)
    w0 = [p.detach().clone() for p in whole.model.parameters()]
    before = model_at(cfg, w0)
    got_whole = whole.apply_gradients([whole.gradients(data, "reinforce")])
    assert "update_scale" not in got_whole  # no bound: the plain step
    w_whole = [p.detach().clone() for p in whole.model.parameters()]
    kl_whole = k3_kl(before, whole.model, data)
    assert kl_whole > 0.01  # a step that moves the policy

    bound = kl_whole / 20
    got = cut.apply_gradients([cut.gradients(data, "reinforce")], max_kl=bound, probe=data)
    s = got["update_scale"]
    assert s in [2.0 ** -k for k in range(1, 11)]
    assert got["update_kl_proposed"] == pytest.approx(kl_whole, rel=1e-3)
    for p, a, b in zip(cut.model.parameters(), w0, w_whole):
        torch.testing.assert_close(p.detach(), a + s * (b - a), rtol=1e-5, atol=1e-7)
    kl_cut = k3_kl(before, cut.model, data)
    assert kl_cut <= bound and got["update_kl"] == pytest.approx(kl_cut, rel=1e-3, abs=1e-7)
    twice = model_at(cfg, [a + 2 * s * (b - a) for a, b in zip(w0, w_whole)])
    assert k3_kl(before, twice, data) > bound
    assert cut.version == whole.version == 1
    # The optimizer state is that of the whole step (only the step's size was cut).
    for a, b in zip(whole.optimizer.state.values(), cut.optimizer.state.values()):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"])


def test_an_update_within_its_bound_is_the_whole_step():
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
    data = samples(5, 5)
    a, b = (Trainer(build_policy(cfg, seed=2), OptimConfig(lr=1e-3)) for _ in range(2))
    a.apply_gradients([a.gradients(data, "reinforce")])
    got = b.apply_gradients([b.gradients(data, "reinforce")], max_kl=1e6, probe=data)
    assert got["update_scale"] == 1.0 and got["update_kl"] == got["update_kl_proposed"] >= 0
    assert all(torch.equal(p, q) for p, q in zip(a.model.parameters(), b.model.parameters()))


def test_probe_takes_whole_samples_then_a_prefix_within_its_tokens():
    data = samples(4, 6)
    n0, n1, n2 = (len(s.tokens) for s in data[:3])
    budget = n0 + n1 + n2 // 2 + 2  # the third sample's prefix holds trained tokens (its second half)
    probe = probe_of(data, budget)
    assert len(probe) == 3 and probe[0] is data[0] and probe[1] is data[1]
    head = probe[2]
    k = budget - n0 - n1
    assert len(head.tokens) == k and sum(len(s.tokens) for s in probe) == budget
    np.testing.assert_array_equal(head.tokens, data[2].tokens[:k])
    np.testing.assert_array_equal(head.trained, data[2].trained[:k])
    np.testing.assert_array_equal(head.logprobs, data[2].logprobs[:k])
    assert head.n_trained == int(data[2].trained[:k].sum()) > 0
    # A prefix with nothing trained in it measures nothing; when nothing else fits, the shortest
    # sample goes whole (an update is never left unmeasured).
    shortest = min(data, key=lambda s: len(s.tokens))
    assert probe_of(data, 3) == [shortest]
    # A tree-shaped sample has no prefix sample: skipped when it does not fit whole.
    tree = PathSample(data[3].tokens, data[3].trained, data[3].logprobs, data[3].versions, 0.0,
                      positions=np.arange(len(data[3].tokens)), prev=np.arange(len(data[3].tokens)) - 1)
    assert probe_of([tree, data[0]], n0) == [data[0]]
    assert probe_of([tree], len(tree.tokens) - 1) == [tree]
    with pytest.raises(ValueError, match="no prefix sample"):
        tree.head(3)


def test_samples_staler_than_the_bound_are_masked():
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
    t = Trainer(build_policy(cfg, seed=1), OptimConfig(), version=5)
    data = samples(6, 3)
    for k, s in enumerate(data):
        s.versions[s.trained] = (5, 4, 3)[k % 3]  # staleness 0, 1, 2
    n = [s.n_trained for s in data]
    out = t.gradients(data, "ppo_clip", max_staleness=1, clip_eps=0.2)
    assert out.tokens == n[0] + n[1] + n[3] + n[4] and out.stale_masked == n[2] + n[5]
    assert out.oldest == 4
    ref = t.gradients([data[i] for i in (0, 1, 3, 4)], "ppo_clip", clip_eps=0.2)
    for name, g in ref.grads.items():
        np.testing.assert_allclose(out.grads[name], g, rtol=1e-5, atol=1e-8)
    assert t.gradients(data, "ppo_clip", clip_eps=0.2).tokens == sum(n)  # no bound: all of them


def test_truncated_importance_weight_on_samples_of_the_current_version():
    """A sample this version drew whose engine log-prob is far below the trainer's (ratio >> cap):
    scored at ratio 1 with weight cap, its gradient is cap times REINFORCE's; samples of an older
    version keep the plain ratio against the engine."""
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)
    t = Trainer(build_policy(cfg, seed=1), OptimConfig(), version=5)
    data = samples(4, 5)
    for s in data:
        s.versions[s.trained] = 5
        s.logprobs[s.trained] = -60.0  # the trainer's own log-probs are near -5.5: ratio ~ e^54
    tis = t.gradients(data, "ppo_clip", is_cap=2.0, clip_eps=0.2)
    plain = t.gradients(data, "reinforce")
    for name, g in plain.grads.items():
        np.testing.assert_allclose(tis.grads[name], 2.0 * g, rtol=1e-4, atol=1e-7, err_msg=name)
    for s in data:
        s.versions[s.trained] = 4  # drawn by the previous version: no correction, PPO clips instead
    old = t.gradients(data, "ppo_clip", is_cap=2.0, clip_eps=0.2)
    # every ratio is far above 1 + eps: the clip is the active branch wherever the advantage is positive
    assert old.sums["clip_frac"] == pytest.approx(sum(s.n_trained for s in data if s.advantage > 0))
    assert 0 < old.sums["clip_frac"] < old.tokens


# ----------------------------------------------------------------- reduction on the cells

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)


def test_cell_sums_give_the_update_of_every_share_and_count_a_share_once():
    from gyreflow.train.reduce import CellSums, msg_to_share, share_to_msg

    data = samples(9, 4)
    parts = partition([int(s.trained.sum()) for s in data], 4)
    ref = Trainer(build_policy(TINY, seed=2), OptimConfig(lr=1e-2), version=5)
    t = Trainer(build_policy(TINY, seed=2), OptimConfig(lr=1e-2), version=5)
    shares = [t.gradients([data[i] for i in b], "ppo_clip", clip_eps=0.2) for b in parts]
    want = ref.apply_gradients([ref.gradients([data[i] for i in b], "ppo_clip", clip_eps=0.2) for b in parts])
    cells = [CellSums(), CellSums()]  # shares 0, 2 on one cell, 1, 3 on the other
    light = [cells[k % 2].add("run", f"grad-{k}", s) for k, s in enumerate(shares)]
    assert all(s.grads is None and s.key == f"grad-{k}" for k, s in enumerate(light))
    cells[0].add("run", "grad-0", shares[0])  # a share delivered twice is summed once
    with pytest.raises(KeyError, match="not"):
        cells[1].take("run", 5, ["grad-1"])  # not exactly what the cell holds: refused, kept
    sums = [cells[0].take("run", 5, ["grad-0", "grad-2"]), cells[1].take("run", 5, ["grad-1", "grad-3"])]
    assert len(cells[0]) == len(cells[1]) == 0
    sums[1] = msg_to_share(share_to_msg(sums[1]))  # as it crosses the wire
    got = t.apply_gradients(sums)
    assert got["shares"] == 4 and got["trained_tokens"] == want["trained_tokens"]
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    for (name, a), b in zip(ref.model.named_parameters(), t.model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_shares_of_different_versions_are_not_summed():
    from gyreflow.train.reduce import CellSums, merge

    t = Trainer(build_policy(TINY, seed=1), OptimConfig(), version=2)
    a = t.gradients(samples(2, 1), "reinforce")
    t.version = 3
    b = t.gradients(samples(2, 2), "reinforce")
    with pytest.raises(ValueError, match="versions 2 and 3"):
        merge([a, b])
    sums = CellSums()
    sums.add("run", "a", a)
    sums.add("run", "b", b)  # another step's sum on the same cell
    assert len(sums) == 2 and sums.take("run", 3, ["b"]).tokens == b.tokens


def assert_adam_step(got: np.ndarray, want: torch.Tensor, before: torch.Tensor, grad: torch.Tensor, name: str) -> None:
    """Weights after Adam's first step as expected where the gradient is clear of Adam's eps (there
    the step is the learning rate times its sign); elsewhere a gradient summed in another order can
    move its weight by anything up to that step, and no further."""
    clear = (grad.abs() > 1e-6).numpy()  # (shape,) bool
    np.testing.assert_allclose(got[clear], want.numpy()[clear], rtol=1e-4, atol=1e-6, err_msg=name)
    bound = float((want - before).abs().max()) * (1 + 1e-4) + 1e-7
    assert np.abs(got - before.numpy()).max() <= bound, name


def optimizer_mass(state) -> float:
    return float(sum(v["exp_avg"].abs().sum() for v in state.optimizer["state"].values()))


def test_two_trainer_cells_reduce_their_own_shares(tmp_path):
    """On a real cluster: a group's shares run on two trainer cells, each keeps its gradients in
    its own sum, and the update (on one of them) takes one sum per cell: the same update as one
    trainer on every sample."""
    from distributed import Client

    from gyreflow.cluster.local import PoolSpec, local_cluster
    from gyreflow.stages import _published, apply_update, gradient_share, weights_of
    from gyreflow.train.state import GroupSamples, PolicyState
    from gyreflow.cluster.pools import TRAINER
    from gyreflow.train.service import TrainerService

    data = samples(8, 7)
    model = build_policy(TINY, seed=3)
    optim = OptimConfig(lr=1e-2)
    published = _published(model, 0, optim, "shares-test")
    state = PolicyState(published)
    ref = Trainer(build_policy(TINY, seed=3), optim, version=0)
    want = ref.rl_step(data, "ppo_clip", clip_eps=0.2)
    w0 = [p.detach().clone() for p in model.parameters()]
    w_ref = [p.detach().clone() for p in ref.model.parameters()]
    bound = k3_kl(model_at(TINY, w0), ref.model, data) / 10
    group = GroupSamples(data, [], [])
    with local_cluster(PoolSpec(rollout=1, trainer=2, execution_slots=1)) as cluster, Client(cluster) as client:
        info = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
        cells = sorted(a for a, w in info.items() if w.get("resources", {}).get(TRAINER))
        assert len(cells) == 2
        client.register_plugin(TrainerService(torch_threads=1))
        shares = [client.submit(gradient_share, group, published, j, 4, "ppo_clip", {"clip_eps": 0.2},
                                key=f"grad-0-t-{j}", workers=[cells[j % 2]], allow_other_workers=False)
                  for j in range(4)]
        light = client.gather(shares)
        assert {s.worker for s in light} == set(cells) and all(s.grads is None for s in light)
        new_f = client.submit(apply_update, 0, shares, state, key="update-0", workers=[cells[0]],
                              allow_other_workers=False)
        new = new_f.result()
        assert new.metrics["shares"] == 4 and new.metrics["share_workers"] == cells
        assert new.metrics["trained_tokens"] == want["trained_tokens"] and new.version == 1
        assert new.metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        # Nothing is left behind on either cell.
        left = client.run(lambda dask_worker: len(dask_worker.plugins["gyreflow-trainer"].sums), workers=cells)
        assert set(left.values()) == {0}
        # The state an update returned stays as it was when its cell applies the next update (Dask
        # may still hand it to a checkpoint): it holds no tensor of the live optimizer.
        first = optimizer_mass(new)
        shares = [client.submit(gradient_share, GroupSamples(samples(6, 8), [], []), client.submit(weights_of, new_f),
                                j, 2, "ppo_clip", {"clip_eps": 0.2}, key=f"grad-1-t-{j}", workers=[cells[0]],
                                allow_other_workers=False) for j in range(2)]
        assert client.submit(apply_update, 1, shares, new_f, key="update-1", workers=[cells[0]],
                             allow_other_workers=False).result().version == 2
        assert client.submit(optimizer_mass, new_f, workers=[cells[0]], pure=False).result() == first
        # The same step under a KL bound, updated on the other cell: each share brings a probe of
        # its samples, and the update is cut to a halving of the whole one within the bound.
        shares = [client.submit(gradient_share, group, published, j, 4, "ppo_clip", {"clip_eps": 0.2}, None, 0.0,
                                10_000, key=f"grad-0-bounded-{j}", workers=[cells[j % 2]], allow_other_workers=False)
                  for j in range(4)]
        cut = client.submit(apply_update, 0, shares, state, bound, 10_000, key="update-0-bounded", workers=[cells[1]],
                            allow_other_workers=False).result()
    s = cut.metrics["update_scale"]
    assert s < 1 and cut.metrics["update_kl"] <= bound
    for (name, p), a, b in zip(ref.model.named_parameters(), w0, w_ref):
        assert_adam_step(new.published.weights[name], b, a, p.grad, name)
        assert_adam_step(cut.published.weights[name], a + s * (b - a), a, p.grad, name)


def _after_gate(gate, step, shares, state):
    """``apply_update`` once ``gate`` (a task's result) is there: an update held back."""
    from gyreflow.stages import apply_update

    return apply_update(step, shares, state)


def _wait_open(name: str) -> bool:
    from distributed import Event

    return Event(name).wait(60)


def test_a_leaving_trainer_cell_stays_until_the_update_took_its_gradient_sums():
    """A trainer cell retired between its shares and their update: its gradient sums live in its
    memory, so it leaves only once the update has taken them (the update equals one trainer on
    every sample), and Dask's own downscaling spares it meanwhile."""
    import sys
    import threading

    import cloudpickle
    from distributed import Client, Event

    from gyreflow.cluster.local import PoolSpec, install, local_cluster, workers_info
    from gyreflow.cluster.pools import EXECUTION, TRAINER
    from gyreflow.stages import _published, gradient_share
    from gyreflow.train.state import GroupSamples, PolicyState

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    data = samples(8, 7)
    optim = OptimConfig(lr=1e-2)
    published = _published(build_policy(TINY, seed=3), 0, optim, "leave-test")
    want = Trainer(build_policy(TINY, seed=3), optim, version=0).rl_step(data, "ppo_clip", clip_eps=0.2)
    with local_cluster(PoolSpec(rollout=1, trainer=2, execution_slots=2)) as cluster, Client(cluster) as client:
        client.wait_for_workers(4)
        install(client, torch_threads=1, engine_options={"max_batch": 4, "max_seq_len": 256}, mode="async")
        info = workers_info(client)
        cells = sorted(a for a, w in info.items() if w.get("resources", {}).get(TRAINER))
        shares = [client.submit(gradient_share, GroupSamples(data, [], []), published, j, 4, "ppo_clip",
                                {"clip_eps": 0.2}, key=f"grad-0-leave-{j}", workers=[cells[j % 2]],
                                allow_other_workers=False, resources={TRAINER: 1}) for j in range(4)]
        # The update is submitted with its shares, as a step's graph is.
        gate = client.submit(_wait_open, "open-update", key="gate", resources={EXECUTION: 1})
        update = client.submit(_after_gate, gate, 0, shares, PolicyState(published), key="update-0-leave",
                               workers=[cells[0]], allow_other_workers=False, resources={TRAINER: 1})
        client.gather(shares)
        retired: dict = {}
        leaving = threading.Thread(target=lambda: retired.update(
            client.sync(client.scheduler.gyreflow_retire, cell=cells[1])))
        leaving.start()
        closing = client.sync(client.scheduler.workers_to_close, n=10)
        assert cells[1] not in closing  # downscaling spares the cell whose sums are still needed
        Event("open-update", client=client).set()
        new = update.result(timeout=60)
        leaving.join(timeout=60)
        assert not leaving.is_alive() and "error" not in retired, retired
        assert retired["results_wait_s"] > 0  # it waited for the update
        assert cells[1] not in workers_info(client)
    assert new.metrics["shares"] == 4 and new.metrics["share_workers"] == cells
    assert new.metrics["trained_tokens"] == want["trained_tokens"]
    assert new.metrics["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
