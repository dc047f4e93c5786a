"""Prefix-sharing trajectory trees built from call records."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from gyreflow.trajectory.records import CallRecord, ExecutionResult
from gyreflow.trajectory.roles import infer_roles
from gyreflow.trajectory.tree import TrajectoryTree, build_tree


def _call(
    index: int,
    prompt: list[int] | np.ndarray,
    completion: list[int] | np.ndarray,
    *,
    logprobs: list[float] | np.ndarray | None = None,
    versions: list[int] | np.ndarray | None = None,
    role: str = "main",
) -> CallRecord:
    c = len(completion)
    if logprobs is None:
        # distinct per call and position, so a mix-up between calls shows
        logprobs = [-(index + 1) - 0.01 * j for j in range(c)]
    if versions is None:
        versions = [index] * c
    return CallRecord(
        execution_id="e0",
        call_index=index,
        call_id=f"c{index}",
        role=role,
        prompt_ids=np.asarray(prompt, dtype=np.int32),
        completion_ids=np.asarray(completion, dtype=np.int32),
        logprobs=np.asarray(logprobs, dtype=np.float32),
        versions=np.asarray(versions, dtype=np.int32),
    )


def _result(calls: list[CallRecord], reward: float = 0.5) -> ExecutionResult:
    return ExecutionResult(
        execution_id="e0", task_id="t0", step=3, sample=1, split="train", calls=calls,
        reward=reward, passed=False, end_reason="done",
    )


def _seq(call: CallRecord) -> list[int]:
    return [*call.prompt_ids.tolist(), *call.completion_ids.tolist()]


def _check_sampled_once(calls: list[CallRecord], tree: TrajectoryTree, leaves=None) -> None:
    """Every sample of every call (each sampled token at its context, once per call that sampled
    it) is trained exactly once over the paths, with that call's own log-prob and version."""
    expected: Counter = Counter()
    for call in calls:
        seq, p = _seq(call), len(call.prompt_ids)
        for j in range(len(call.completion_ids)):
            expected[(tuple(seq[: p + j + 1]), float(call.logprobs[j]), int(call.versions[j]))] += 1
    trained: Counter = Counter()
    for path in tree.paths(leaves):
        toks = path.tokens.tolist()
        for i in np.flatnonzero(path.loss_mask):
            trained[(tuple(toks[: i + 1]), float(path.logprobs[i]), int(path.versions[i]))] += 1
        for i, lp, v in zip(path.extra_pos.tolist(), path.extra_logprobs.tolist(), path.extra_versions.tolist()):
            assert path.loss_mask[i], "an extra sample of a token the path does not train"
            trained[(tuple(toks[: i + 1]), float(lp), int(v))] += 1
    assert trained == expected
    assert tree.n_samples == sum(len(c.completion_ids) for c in calls) == sum(p.n_trained for p in tree.paths(leaves))


# ------------------------------------------------------------------------------------- chain

SYSTEM = [1, 2, 3, 4, 5]


def _chain_calls() -> list[CallRecord]:
    c0 = _call(0, SYSTEM, [10, 11, 12])
    c1 = _call(1, _seq(c0) + [20, 21], [30, 31])
    c2 = _call(2, _seq(c1) + [40], [50, 51, 52, 53])
    return [c0, c1, c2]


def test_chain_is_one_sequence() -> None:
    calls = _chain_calls()
    tree = build_tree(_result(calls, reward=0.75))
    assert tree.n_nodes == 1 and tree.n_leaves == 1
    last = _seq(calls[-1])
    assert tree.unique_tokens == len(last) == 17
    assert tree.total_tokens == 8 + 12 + 17
    assert tree.reward == 0.75 and tree.execution_id == "e0" and tree.task_id == "t0"
    (path,) = tree.paths()
    assert path.tokens.dtype == np.int32 and path.tokens.tolist() == last
    sampled_at = [5, 6, 7, 10, 11, 13, 14, 15, 16]
    assert np.flatnonzero(path.sampled).tolist() == sampled_at
    assert path.owned.all()
    np.testing.assert_allclose(
        path.logprobs[sampled_at],
        [-1.0, -1.01, -1.02, -2.0, -2.01, -3.0, -3.01, -3.02, -3.03],
        rtol=1e-6,
    )
    assert path.versions[sampled_at].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert np.all(path.logprobs[~path.sampled] == 0) and np.all(path.versions[~path.sampled] == -1)
    assert path.role == "main" and path.call_index == 2
    _check_sampled_once(calls, tree)


def test_call_order_of_records_does_not_matter() -> None:
    calls = _chain_calls()
    a, _ = build_tree(_result(calls)).to_arrays()
    b, _ = build_tree(_result(calls[::-1])).to_arrays()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


# --------------------------------------------------------------------------------- branching


def test_compaction_branches() -> None:
    c0, c1, _ = _chain_calls()
    # summarizer sees the whole history and writes a summary
    s = _call(2, _seq(c1) + [90], [91, 92], role="main-summary")
    # after compaction the agent restarts from the system prompt + summary: shares only 5 tokens
    c3 = _call(3, SYSTEM + [91, 92, 60], [61, 62])
    calls = [c0, c1, s, c3]
    tree = build_tree(_result(calls))
    assert tree.n_leaves == 2
    paths = tree.paths()
    assert [p.tokens.tolist() for p in paths] == [_seq(s), _seq(c3)]
    assert [p.role for p in paths] == ["main-summary", "main"]
    # the shared system prompt is owned by the first path only
    assert paths[0].owned[:5].all() and not paths[1].owned[:5].any()
    assert paths[1].owned[5:].all() and paths[0].owned.all()
    assert tree.unique_tokens == len(_seq(s)) + len(_seq(c3)) - 5
    assert tree.n_nodes == 3
    _check_sampled_once(calls, tree)


def test_branch_inside_completion() -> None:
    # a retry resamples from the same prompt and diverges after two sampled tokens
    c0 = _call(0, [1, 2], [3, 4, 5, 6])
    c1 = _call(1, [1, 2], [3, 4, 7])
    tree = build_tree(_result([c0, c1]))
    assert tree.n_nodes == 3 and tree.n_leaves == 2
    p0, p1 = tree.paths()
    assert p0.loss_mask.tolist() == [False, False, True, True, True, True]
    assert p1.loss_mask.tolist() == [False, False, False, False, True]
    # shared sampled tokens keep the first call's log-probs in both paths
    np.testing.assert_allclose(p1.logprobs[2:4], [-1.0, -1.01], rtol=1e-6)
    np.testing.assert_allclose(p1.logprobs[4], -2.02, rtol=1e-6)
    _check_sampled_once([c0, c1], tree)


def test_paths_subset_reassigns_ownership() -> None:
    c0 = _call(0, [1, 2], [3, 4, 5, 6])
    c1 = _call(1, [1, 2], [3, 4, 7])
    c2 = _call(2, [1, 2], [8])
    tree = build_tree(_result([c0, c1, c2]))
    assert tree.n_leaves == 3
    (only,) = tree.paths([1])
    assert only.owned.all() and only.leaf == 1 and only.tokens.tolist() == [1, 2, 3, 4, 7]
    q2, q0 = tree.paths([2, 0])
    assert q2.owned.all()
    assert q0.owned.tolist() == [False, False, True, True, True, True]
    with pytest.raises(ValueError):
        tree.paths([0, 0])
    with pytest.raises(ValueError):
        tree.paths([3])


# ---------------------------------------------------------------------------- duplicates etc.


def test_identical_retry_adds_samples_not_tokens() -> None:
    calls = _chain_calls()
    retry = _call(3, calls[1].prompt_ids, calls[1].completion_ids, logprobs=[-9.0, -8.0], versions=[5, 6])
    base = build_tree(_result(calls))
    tree = build_tree(_result(calls + [retry]))
    assert tree.n_nodes == base.n_nodes and tree.unique_tokens == base.unique_tokens
    assert tree.total_tokens == base.total_tokens + len(_seq(retry))
    a, b = base.to_arrays()[0], tree.to_arrays()[0]
    for name in ("tokens", "sampled", "logprobs", "versions", "node_offsets", "node_parent"):
        np.testing.assert_array_equal(a[name], b[name])  # first sampler's log-probs kept
    # The two tokens call 1 sampled were sampled again: counted twice, the retry's own data kept.
    assert b["extra_index"].tolist() == [10, 11] and len(a["extra_index"]) == 0
    assert b["extra_logprobs"].tolist() == [-9.0, -8.0] and b["extra_versions"].tolist() == [5, 6]
    assert tree.sample_counts()[[10, 11]].tolist() == [2, 2]
    assert tree.n_samples == base.n_samples + 2 == 11
    (path,) = tree.paths()
    assert path.extra_pos.tolist() == [10, 11] and path.n_trained == 11
    _check_sampled_once(calls + [retry], tree)


def test_looping_agent_after_compaction_counts_every_sample() -> None:
    """An agent that compacts and then repeats the same wrong call: every repeat is a sample."""
    go = [70, 71, 72]
    calls, context = [], SYSTEM + [60]
    for i in range(6):
        calls.append(_call(i, context, go))
        # compaction every second call: back to the same summary, so the same context recurs
        context = context + go + [80] if i % 2 == 0 else SYSTEM + [60]
    tree = build_tree(_result(calls))
    assert tree.n_samples == 18  # 6 calls x 3 sampled tokens
    first = [p for p in tree.paths() if p.tokens.tolist()[:9] == SYSTEM + [60] + go]
    counts = tree.sample_counts()
    assert sorted(counts[counts > 0].tolist()) == [3, 3, 3, 3, 3, 3]
    assert first and sum(p.n_trained for p in tree.paths()) == 18
    _check_sampled_once(calls, tree)


def test_best_of_n_and_sub_agents_on_one_prompt() -> None:
    prompt = [1, 2, 3]
    calls = [
        _call(0, prompt, [7, 8, 9]), _call(1, prompt, [7, 8, 9]), _call(2, prompt, [7, 8, 10]),
        _call(3, prompt, [7, 11]), _call(4, prompt, [7, 8, 9], role="sub-agent"),
    ]
    tree = build_tree(_result(calls))
    assert tree.n_leaves == 3 and tree.n_samples == 14
    counts = dict(zip(map(int, tree.tokens), tree.sample_counts().tolist()))
    assert counts[7] == 5 and counts[8] == 4 and counts[9] == 3 and counts[10] == 1 and counts[11] == 1
    _check_sampled_once(calls, tree)
    # any subset of leaves, in any order, still trains the samples of the nodes it covers once
    for leaves in ([2], [1, 0], [2, 0, 1]):
        sub = tree.paths(leaves)
        covered = sum(p.n_trained for p in sub)
        assert covered == sum(int(tree.sample_counts()[tree.node_offsets[n]:tree.node_offsets[n + 1]].sum())
                              for n in {int(n) for p in sub for n in p.nodes})


def test_prefix_call_adds_nothing() -> None:
    c0 = _call(0, [1, 2, 3, 4], [5, 6])
    c1 = _call(1, [1, 2], [3])  # ends inside c0's sequence, samples a token c0 had as prompt
    tree = build_tree(_result([c0, c1]))
    assert tree.n_nodes == 1 and tree.unique_tokens == 6
    (path,) = tree.paths()
    assert path.sampled.tolist() == [False, False, True, False, True, True]
    assert path.logprobs[2] == pytest.approx(-2.0) and path.versions[2] == 1
    assert path.role == "main" and path.call_index == 0


def test_completion_stays_sampled_when_reused_as_prompt() -> None:
    c0 = _call(0, [1, 2], [3, 4], logprobs=[-0.5, -0.25], versions=[7, 8])
    c1 = _call(1, [1, 2, 3, 4, 9], [10])
    (path,) = build_tree(_result([c0, c1])).paths()
    assert path.sampled.tolist() == [False, False, True, True, False, True]
    assert path.logprobs[2:4].tolist() == [-0.5, -0.25]
    assert path.versions.tolist() == [-1, -1, 7, 8, -1, 1]


def test_prompt_text_later_sampled_becomes_sampled() -> None:
    c0 = _call(0, [1, 2, 3, 4], [5])  # 3, 4 are prompt text here
    c1 = _call(1, [1, 2], [3, 4, 6])  # and sampled here
    tree = build_tree(_result([c0, c1]))
    p0, p1 = tree.paths()
    assert p0.sampled.tolist() == [False, False, True, True, True]
    assert p0.versions.tolist() == [-1, -1, 1, 1, 0]
    assert p1.loss_mask.tolist() == [False, False, False, False, True]
    _check_sampled_once([c0, c1], tree)


def test_empty_execution() -> None:
    tree = build_tree(_result([]))
    assert tree.n_nodes == 0 and tree.n_leaves == 0 and tree.paths() == []
    assert tree.unique_tokens == 0 and tree.total_tokens == 0
    assert TrajectoryTree.from_arrays(*tree.to_arrays()).n_nodes == 0


# ------------------------------------------------------------------------------------ archive


def test_arrays_round_trip() -> None:
    c0, c1, _ = _chain_calls()
    s = _call(2, _seq(c1) + [90], [91, 92], role="main-summary")
    c3 = _call(3, SYSTEM + [91, 92, 60], [61, 62])
    tree = build_tree(_result([c0, c1, s, c3]))
    arrays, meta = tree.to_arrays()
    assert all(isinstance(v, np.ndarray) for v in arrays.values())
    meta = json.loads(json.dumps(meta))
    back = TrajectoryTree.from_arrays({k: v.copy() for k, v in arrays.items()}, meta)
    assert (back.execution_id, back.task_id, back.reward) == ("e0", "t0", 0.5)
    assert (back.total_tokens, back.n_calls, back.roles) == (tree.total_tokens, 4, tree.roles)
    for p, q in zip(tree.paths(), back.paths(), strict=True):
        for name in ("tokens", "sampled", "logprobs", "versions", "owned", "nodes", "extra_pos", "extra_logprobs",
                     "extra_versions", "extra_temperatures", "temperatures"):
            np.testing.assert_array_equal(getattr(p, name), getattr(q, name))
        assert (p.role, p.call_index, p.leaf) == (q.role, q.call_index, q.leaf)


def test_from_arrays_rejects_bad_structure() -> None:
    arrays, meta = build_tree(_result(_chain_calls())).to_arrays()
    bad = dict(arrays, node_parent=np.array([0], dtype=np.int32))  # its own parent
    with pytest.raises(ValueError, match="earlier node"):
        TrajectoryTree.from_arrays(bad, meta)
    with pytest.raises(ValueError, match="missing"):
        TrajectoryTree.from_arrays({"tokens": arrays["tokens"]}, meta)
    extra = {"extra_index": np.array([0]), "extra_logprobs": np.array([-1.0]), "extra_versions": np.array([0]),
             "extra_temperatures": np.array([1.0])}
    with pytest.raises(ValueError, match="not sampled"):  # token 0 is prompt text
        TrajectoryTree.from_arrays(arrays | extra, meta)
    with pytest.raises(ValueError, match="ascending"):
        TrajectoryTree.from_arrays(arrays | extra | {"extra_index": np.array([99])}, meta)
    with pytest.raises(ValueError, match="differ in length"):
        TrajectoryTree.from_arrays(arrays | extra | {"extra_versions": np.array([0, 1])}, meta)
    # a tree stored before extra samples existed reads as having none
    old = {k: v for k, v in arrays.items() if not k.startswith("extra_") and k != "temperatures"}
    back = TrajectoryTree.from_arrays(old, meta)
    assert back.n_samples == 9 and np.all(back.temperatures == 1.0)


# --------------------------------------------------------------------- randomized vs reference


def _reference(calls: list[CallRecord]) -> dict[tuple[int, ...], tuple[bool, float, int]]:
    """Prefix → (sampled, logprob, version), the set-of-prefixes view of the trie."""
    ref: dict[tuple[int, ...], tuple[bool, float, int]] = {}
    for call in sorted(calls, key=lambda c: c.call_index):
        seq, p = _seq(call), len(call.prompt_ids)
        for i in range(len(seq)):
            key = tuple(seq[: i + 1])
            s = i >= p
            info = (False, 0.0, -1)
            if s:
                info = (True, float(call.logprobs[i - p]), int(call.versions[i - p]))
            if key not in ref or (s and not ref[key][0]):
                ref[key] = info
    return ref


def _random_calls(rng: np.random.Generator) -> list[CallRecord]:
    calls: list[CallRecord] = []
    for index in range(int(rng.integers(1, 9))):
        if calls and rng.random() < 0.1:
            prev = calls[int(rng.integers(len(calls)))]
            calls.append(_call(index, prev.prompt_ids, prev.completion_ids))
            continue
        base: list[int] = []
        if calls and rng.random() < 0.8:
            prev_seq = _seq(calls[int(rng.integers(len(calls)))])
            base = prev_seq[: int(rng.integers(0, len(prev_seq) + 1))]
        seq = base + rng.integers(0, 3, size=int(rng.integers(0, 7))).tolist()
        cut = int(rng.integers(0, len(seq) + 1))
        calls.append(
            _call(
                index, seq[:cut], seq[cut:],
                logprobs=-rng.random(len(seq) - cut), versions=rng.integers(0, 4, len(seq) - cut),
                role=str(rng.choice(["main", "main-summary"])),
            )
        )
    return calls


@pytest.mark.parametrize("seed", range(300))
def test_matches_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    calls = _random_calls(rng)
    tree = build_tree(_result(calls))
    ref = _reference(calls)
    n_children = Counter(k[:-1] for k in ref)
    leaves = {k for k in ref if n_children[k] == 0}
    # a compressed trie starts a node at the root's children and after every branching point
    node_starts = {k for k in ref if len(k) == 1 or n_children[k[:-1]] >= 2}

    assert tree.unique_tokens == len(ref)
    assert tree.n_leaves == len(leaves)
    assert tree.n_nodes == len(node_starts)
    assert tree.total_tokens == sum(len(_seq(c)) for c in calls)
    paths = tree.paths()
    assert {tuple(p.tokens.tolist()) for p in paths} == leaves
    owned: Counter = Counter()
    for p in paths:
        toks = p.tokens.tolist()
        for i in range(len(toks)):
            key = tuple(toks[: i + 1])
            s, lp, v = ref[key]
            assert (bool(p.sampled[i]), float(p.logprobs[i]), int(p.versions[i])) == (
                s, pytest.approx(lp), v
            )
            owned[key] += int(p.owned[i])
    assert set(owned) == set(ref) and all(n == 1 for n in owned.values())
    # ownership among a random subset, in a random priority order
    if tree.n_leaves:
        order = rng.permutation(tree.n_leaves)[: int(rng.integers(1, tree.n_leaves + 1))].tolist()
        sub = tree.paths(order)
        covered = {tuple(p.tokens[: i + 1].tolist()) for p in sub for i in range(len(p))}
        sub_owned = Counter(
            tuple(p.tokens[: i + 1].tolist()) for p in sub for i in np.flatnonzero(p.owned)
        )
        assert set(sub_owned) == covered and all(n == 1 for n in sub_owned.values())
    _check_sampled_once(calls, tree)


def test_long_chain_with_compactions() -> None:
    rng = np.random.default_rng(0)
    calls: list[CallRecord] = []
    context = rng.integers(0, 50_000, 300).tolist()
    for index in range(200):
        if index % 50 == 49:  # compaction: restart from the first 300 tokens plus a summary
            context = context[:300] + rng.integers(0, 50_000, 20).tolist()
        completion = rng.integers(0, 50_000, 150).tolist()
        calls.append(_call(index, context, completion))
        context = context + completion + rng.integers(0, 50_000, 50).tolist()
    tree = build_tree(_result(calls))
    assert tree.n_leaves == 5  # the original context + 4 compactions (calls 49, 99, 149, 199)
    assert tree.unique_tokens < tree.total_tokens / 10
    assert sum(int(p.loss_mask.sum()) for p in tree.paths()) == 200 * 150


# ------------------------------------------------------------------------ roles and bounded sampling


def _roles_tree():
    """main chain; a sub-agent on its own prompt; each summarized; the main agent goes on from
    its summary."""
    m0 = _call(0, SYSTEM, [10, 11], role="")
    m1 = _call(1, _seq(m0) + [20], [12, 13], role="")
    sub = _call(2, [8, 9, 7], [30, 31, 32], role="")  # another system prompt: a sub-agent
    sub_sum = _call(3, _seq(sub) + [33], [34, 35], role="")  # nothing continues it; reused below
    m_sum = _call(4, _seq(m1) + [21], [40, 41, 42], role="")
    m2 = _call(5, SYSTEM + [40, 41, 42, 34, 35, 22], [14], role="")  # compacted: both summaries
    return [m0, m1, sub, sub_sum, m_sum, m2]


def test_roles_are_inferred_when_absent() -> None:
    calls = _roles_tree()
    tree = build_tree(_result(calls))
    by_call = {p.call_index: p.role for p in tree.paths()}
    assert by_call == {3: "sub-agent-summary", 4: "main-summary", 5: "main"}
    leaf_calls = [c.call_index in by_call for c in calls]
    assert infer_roles(calls, leaf_calls) == ["main", "main", "sub-agent", "sub-agent-summary", "main-summary", "main"]
    # a discarded best-of-n sample is not a summary: its completion is never reused
    alt = _call(6, _seq(m := calls[0]), [99, 98], role="")
    tree = build_tree(_result([m, alt, _call(7, _seq(m) + [10], [11], role="")]))
    assert {p.call_index: p.role for p in tree.paths()} == {6: "main", 7: "main"}
    # named roles win, and names of earlier releases read as current ones
    tree = build_tree(_result([_call(0, SYSTEM, [1], role="summarizer")]))
    assert tree.paths()[0].role == "main-summary"


def test_bounded_sampling_follows_role_priority() -> None:
    tree = build_tree(_result(_roles_tree()))
    role = {i: p.role for i, p in enumerate(tree.paths())}
    for j in (1, 2, 3):
        got = tree.sample_paths(j, seed=0)
        assert [role[i] for i in got] == ["main", "main-summary", "sub-agent-summary"][:j]
    assert tree.sample_paths(0, seed=0) == list(range(tree.n_leaves))
    assert tree.sample_paths(10, seed=0) == tree.sample_paths(3, seed=0)  # nothing more to train
    with pytest.raises(ValueError, match="j_max"):
        tree.sample_paths(-1, seed=0)


def test_bounded_sampling_is_proportional_to_untrained_samples_and_masks_chosen_paths() -> None:
    head = _call(0, SYSTEM, [10, 11, 12, 13])  # 4 shared samples
    a = _call(1, _seq(head) + [50], list(range(100, 130)))  # 30 own samples
    b = _call(2, _seq(head) + [51], list(range(200, 210)))  # 10 own samples
    c = _call(3, _seq(head) + [52], [], role="main")  # context only: nothing of its own to train
    tree = build_tree(_result([head, a, b, c]))
    leaf_of = {p.call_index: i for i, p in enumerate(tree.paths())}
    first = Counter(tree.sample_paths(1, seed=s)[0] for s in range(2000))
    # the shared head counts for every path at the first draw: 34 : 14 : 4
    assert first[leaf_of[1]] / 2000 == pytest.approx(34 / 52, abs=0.03)
    assert first[leaf_of[3]] / 2000 == pytest.approx(4 / 52, abs=0.02)
    for s in range(20):
        got = tree.sample_paths(3, seed=s)
        # c has nothing left once the head is taken; drawn first it takes the head
        assert sorted(got) in (sorted([leaf_of[1], leaf_of[2]]), sorted(leaf_of.values()))
        assert got == tree.sample_paths(3, seed=s)  # deterministic
        paths = tree.paths(got)
        assert sum(p.n_trained for p in paths) == tree.n_samples == 44
