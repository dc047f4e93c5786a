"""The shared engine test suite.

``EngineTests`` states what every engine must do; each engine gets a ``Test...`` subclass that says
how to build one (as zarr-python's shared store tests do). References are Hugging Face forward
passes of the same model, recomputed without any cache.
"""

from __future__ import annotations

import pickle
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from gyreflow.engine.base import (
    Engine,
    GenerationRequest,
    GenerationResult,
    LiveRequestState,
    RequestExported,
    SamplingParams,
)
from gyreflow.engine.runner import EngineRunner
from gyreflow.engine.wire import msg_to_result, result_to_msg
from gyreflow.engine.torch_engine import TorchEngine
from gyreflow.faults import FAULTS
from gyreflow.model import ModelConfig, build_policy, state_dict_numpy
from gyreflow.model.policy import LONG_CONTEXT
from gyreflow.model.chat import decode_ids

TINY = ModelConfig(
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,  # grouped-query attention on purpose
    max_position_embeddings=512,
)


LONG = LONG_CONTEXT


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    pass


@pytest.fixture(scope="module")
def model():
    return build_policy(TINY, seed=0)


@pytest.fixture(scope="module")
def long_model():
    return build_policy(LONG, seed=2)


@pytest.fixture(scope="module")
def model_b():
    """Other weights of the same shape, published as a later version."""
    return build_policy(TINY, seed=1)


def prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 262, size=n).astype(np.int32)


def req(rid: str, n: int, key: int, session: str | None = None, ids: np.ndarray | None = None, **params) -> GenerationRequest:
    """A request with an ``n``-token random prompt drawn from ``key``, sampled with seed ``key``
    unless ``seed`` is given."""
    params.setdefault("seed", key)
    ids = prompt(n, key + 1000) if ids is None else ids
    return GenerationRequest(rid, ids, SamplingParams(**params), session=session)


def run_all(engine, futures: list[Future], max_steps: int = 5000) -> list[GenerationResult]:
    """Step ``engine`` until every future is done."""
    for _ in range(max_steps):
        if all(f.done() for f in futures):
            break
        engine.step()
    return [f.result(timeout=0) for f in futures]


def generate(engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    return run_all(engine, [engine.submit(r) for r in requests])


def hf_logits(model, result: GenerationResult) -> torch.Tensor:
    """(C, V) logits the HF model gives before each completion token, from one uncached pass."""
    seq = np.concatenate([result.prompt_ids, result.completion_ids]).astype(np.int64)
    with torch.no_grad():
        logits = model(torch.from_numpy(seq)[None]).logits[0].float()
    p = len(result.prompt_ids)
    return logits[p - 1 : len(seq) - 1]


def hf_logprobs(model, result: GenerationResult, temperature: float) -> np.ndarray:
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(hf_logits(model, result) / t, dim=-1)
    return logp.gather(1, torch.from_numpy(result.completion_ids.astype(np.int64))[:, None])[:, 0].numpy()


def assert_same(a: GenerationResult, b: GenerationResult, atol: float = 1e-5) -> None:
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol, rtol=0)
    np.testing.assert_array_equal(a.versions, b.versions)
    assert a.finish_reason == b.finish_reason


MIXED = [
    # (prompt length, seed, params)
    (3, 1, dict(temperature=1.0, max_tokens=12)),
    (17, 2, dict(temperature=0.7, max_tokens=20)),
    (1, 3, dict(temperature=0.0, max_tokens=9)),
    (40, 4, dict(temperature=1.3, top_p=0.8, max_tokens=15)),
    (8, 5, dict(temperature=0.9, top_p=0.5, max_tokens=6)),
    (25, 6, dict(temperature=1.0, max_tokens=25)),
]


def mixed_requests(prefix: str = "m") -> list[GenerationRequest]:
    return [req(f"{prefix}{i}", n, s, **p) for i, (n, s, p) in enumerate(MIXED)]


class EngineTests:
    """Behaviour every engine shares. Subclasses implement :meth:`make_engine`."""

    supports_logits_hook = False
    """Whether ``make_engine(..., logits_hook=f)`` reports every sampling call's logits."""
    preempts = True
    """Whether running out of KV memory mid-decode preempts requests (else admission waits)."""

    def make_engine(self, model, **kwargs):
        raise NotImplementedError

    def make_engine_with_memory(self, model, tokens: int, **kwargs):
        """An engine whose KV memory holds about ``tokens`` tokens in all."""
        raise NotImplementedError

    # 0. protocol

    def test_is_an_engine(self, model):
        engine = self.make_engine(model)
        assert isinstance(engine, Engine)
        stats = engine.stats()
        for key in ("live", "waiting", "version", "tokens_generated", "iterations", "prefill_tokens", "reused_tokens"):
            assert key in stats

    # 1. cached decode == uncached forward

    def test_decode_logits_match_full_forward(self, model):
        if not self.supports_logits_hook:
            pytest.skip("engine does not report logits")
        seen: dict[str, list[torch.Tensor]] = {}

        def hook(ids, logits):
            for i, rid in enumerate(ids):
                seen.setdefault(rid, []).append(logits[i].cpu())

        engine = self.make_engine(model, logits_hook=hook)
        results = generate(engine, mixed_requests())
        for r in results:
            got = torch.stack(seen[r.request_id])  # (C, V)
            torch.testing.assert_close(got, hf_logits(model, r), atol=1e-4, rtol=0)

    # 2. behaviour log-probs

    def test_logprobs_match_recompute(self, model):
        engine = self.make_engine(model)
        for r, (_, _, p) in zip(generate(engine, mixed_requests()), MIXED):
            np.testing.assert_allclose(r.logprobs, hf_logprobs(model, r, p["temperature"]), atol=1e-4, rtol=0)
            assert r.logprobs.dtype == np.float32 and r.versions.dtype == np.int32
            assert (r.logprobs <= 0).all()

    # 3. continuous batching

    def test_batching_matches_one_at_a_time(self, model):
        alone = [generate(self.make_engine(model), [r])[0] for r in mixed_requests()]
        together = generate(self.make_engine(model), mixed_requests())
        queued = generate(self.make_engine(model, max_batch=2), mixed_requests())
        for a, b, c in zip(alone, together, queued):
            assert_same(a, b)
            assert_same(a, c)

    def test_staggered_arrivals_match_one_at_a_time(self, model):
        alone = [generate(self.make_engine(model), [r])[0] for r in mixed_requests()]
        engine = self.make_engine(model)
        futures = []
        for i, r in enumerate(mixed_requests()):
            futures.append(engine.submit(r))
            for _ in range(i % 3 + 1):
                engine.step()
        for a, b in zip(alone, run_all(engine, futures)):
            assert_same(a, b)

    # 4. live export / import

    def test_export_import_continues_exactly(self, model):
        target = req("moving", 11, 7, temperature=0.9, top_p=0.9, max_tokens=30)
        reference = generate(self.make_engine(model), [target])[0]
        others = mixed_requests("a")
        others_alone = [generate(self.make_engine(model), [r])[0] for r in others]

        src = self.make_engine(model, name="src")
        moving = src.submit(target)
        other_futures = [src.submit(r) for r in others]
        for _ in range(5):
            src.step()
        state = src.export_request("moving")
        with pytest.raises(RequestExported):
            moving.result(timeout=0)
        assert isinstance(state, LiveRequestState)
        assert 0 < len(state.completion_ids) < 30
        assert state.kv.shape[3] == len(state.prompt_ids) + len(state.completion_ids) - 1
        state = pickle.loads(pickle.dumps(state))

        dst = self.make_engine(model, name="dst")
        busy = [dst.submit(r) for r in mixed_requests("b")]  # the destination is not idle
        moved = dst.import_request(state)
        result = run_all(dst, [moved, *busy])[0]
        assert_same(reference, result)
        assert result.engine == "dst"
        # The requests left behind were not disturbed by the hole the export made.
        for a, b in zip(others_alone, run_all(src, other_futures)):
            assert_same(a, b)

    def test_results_say_when_they_were_taken_in_and_finished(self, model):
        src = self.make_engine(model, name="src")
        before = time.time()
        staying = src.submit(req("stays", 5, 1, max_tokens=8))
        src.submit(req("moves", 5, 2, max_tokens=30))
        for _ in range(3):
            src.step()
        exported_at = time.time()
        state = src.export_request("moves")
        [stayed] = run_all(src, [staying])
        assert before <= stayed.received_at <= stayed.finished_at <= time.time()
        # the stamps travel with the result between workers
        again = msg_to_result(result_to_msg(stayed))
        assert (again.received_at, again.finished_at) == (stayed.received_at, stayed.finished_at)
        dst = self.make_engine(model, name="dst")
        [moved] = run_all(dst, [dst.import_request(state)])
        assert moved.received_at is None  # taken in elsewhere
        assert exported_at <= moved.finished_at <= time.time()

    def test_export_waiting_request(self, model):
        target = req("late", 6, 8, temperature=1.0, max_tokens=10)
        reference = generate(self.make_engine(model), [target])[0]
        src = self.make_engine(model, max_batch=1)
        first = src.submit(req("first", 4, 9, max_tokens=5))
        late = src.submit(target)
        src.step()
        state = src.export_request("late")
        assert len(state.completion_ids) == 0
        with pytest.raises(RequestExported):
            late.result(timeout=0)
        run_all(src, [first])
        dst = self.make_engine(model)
        assert_same(reference, run_all(dst, [dst.import_request(state)])[0])
        with pytest.raises(KeyError):
            src.export_request("late")

    # 5. weight versions

    def test_weights_apply_between_iterations(self, model, model_b):
        engine = self.make_engine(model)
        fut = engine.submit(req("v", 5, 10, temperature=1.0, max_tokens=12))
        for _ in range(3):
            engine.step()
        engine.load_weights(state_dict_numpy(model_b), version=1)
        assert engine.version == 0  # staged, not applied mid-flight
        result = run_all(engine, [fut])[0]
        assert engine.version == 1
        n_old = int((result.versions == 0).sum())
        assert n_old > 0 and len(result.versions) == 12
        np.testing.assert_array_equal(result.versions, [0] * n_old + [1] * (12 - n_old))
        # A request under the new version samples from the new weights.
        fresh = generate(engine, [req("after", 9, 11, temperature=0.8, max_tokens=8)])[0]
        assert (fresh.versions == 1).all()
        np.testing.assert_allclose(fresh.logprobs, hf_logprobs(model_b, fresh, 0.8), atol=1e-4, rtol=0)
        assert engine.stats()["version"] == 1

    def test_load_weights_rejects_incomplete(self, model):
        engine = self.make_engine(model)
        weights = state_dict_numpy(model)
        weights.pop("model.norm.weight")
        with pytest.raises(KeyError):
            engine.load_weights(weights, version=1)

    # 6. stopping and sampling

    def test_priority_orders_admission(self, model):
        # One batch slot: waiting requests are admitted lowest priority first, ties in arrival order.
        engine = self.make_engine(model, max_batch=1)
        reqs = [req(name, 5, i, max_tokens=3) for i, name in enumerate("abcd")]
        for r, p in zip(reqs, (5.0, 1.0, 3.0, 1.0)):
            r.priority = p
        futures = {r.request_id: engine.submit(r) for r in reqs}
        order = []
        for _ in range(200):
            engine.step()
            order += [k for k, f in futures.items() if f.done() and k not in order]
            if len(order) == 4:
                break
        assert order == ["b", "d", "c", "a"]

    def test_max_tokens(self, model):
        r = generate(self.make_engine(model), [req("len", 5, 12, max_tokens=7)])[0]
        assert r.finish_reason == "length" and len(r.completion_ids) == 7

    def test_stop_token_ids(self, model):
        base = generate(self.make_engine(model), [req("s", 5, 13, max_tokens=40)])[0]
        stop_id = int(base.completion_ids[10])
        cut = int(np.flatnonzero(base.completion_ids == stop_id)[0]) + 1
        r = generate(self.make_engine(model), [req("s", 5, 13, max_tokens=40, stop_token_ids=(stop_id,))])[0]
        assert r.finish_reason == "stop"
        np.testing.assert_array_equal(r.completion_ids, base.completion_ids[:cut])

    def test_stop_strings(self, model):
        base = generate(self.make_engine(model), [req("s", 5, 14, max_tokens=60)])[0]
        ascii_at = [i for i, t in enumerate(base.completion_ids) if 32 <= t < 127 and i >= 3]
        stop = chr(int(base.completion_ids[ascii_at[0]]))
        cut = next(i + 1 for i in range(len(base.completion_ids)) if decode_ids(base.completion_ids[: i + 1]).endswith(stop))
        r = generate(self.make_engine(model), [req("s", 5, 14, max_tokens=60, stop=("\x00never", stop))])[0]
        assert r.finish_reason == "stop"
        np.testing.assert_array_equal(r.completion_ids, base.completion_ids[:cut])
        assert decode_ids(r.completion_ids).endswith(stop)

    def test_greedy_is_deterministic_argmax(self, model):
        a = generate(self.make_engine(model), [req("g", 9, 15, temperature=0.0, max_tokens=12, seed=1)])[0]
        b = generate(self.make_engine(model), [req("g", 9, 15, temperature=0.0, max_tokens=12, seed=2)])[0]
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        np.testing.assert_array_equal(a.completion_ids, hf_logits(model, a).argmax(-1).numpy())

    def test_seeds(self, model):
        a, b, c = (
            generate(self.make_engine(model), [req("x", 6, 16, max_tokens=16, seed=s)])[0] for s in (5, 5, 6)
        )
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        assert not np.array_equal(a.completion_ids, c.completion_ids)
        # Unseeded requests draw their own seeds.
        d, e = generate(self.make_engine(model), [req("d", 6, 16, max_tokens=16, seed=None), req("e", 6, 16, max_tokens=16, seed=None)])
        assert not np.array_equal(d.completion_ids, e.completion_ids)

    def test_top_p(self, model):
        # A nucleus this small holds only the most likely token: greedy, with untruncated log-probs.
        tiny = generate(self.make_engine(model), [req("p", 7, 17, temperature=1.0, top_p=1e-6, max_tokens=10)])[0]
        logits = hf_logits(model, tiny)
        np.testing.assert_array_equal(tiny.completion_ids, logits.argmax(-1).numpy())
        np.testing.assert_allclose(tiny.logprobs, hf_logprobs(model, tiny, 1.0), atol=1e-4, rtol=0)
        assert (tiny.logprobs < -1.0).all()  # near-uniform random model: far from log(1)
        # Every token sampled with top_p=0.3 lies in its step's nucleus.
        r = generate(self.make_engine(model), [req("q", 7, 18, temperature=1.0, top_p=0.3, max_tokens=30)])[0]
        probs = torch.softmax(hf_logits(model, r).double(), dim=-1)
        for row, tok in zip(probs, r.completion_ids):
            sorted_p, order = torch.sort(row, descending=True)
            n_keep = int(((sorted_p.cumsum(0) - sorted_p) < 0.3).sum())
            assert int(tok) in order[:n_keep].tolist()

    # 7. session prefix reuse

    def test_session_prefix_reuse(self, model):
        first = req("t1", 20, 19, session="s", temperature=0.8, max_tokens=10)
        engine = self.make_engine(model)
        r1 = generate(engine, [first])[0]
        follow_ids = np.concatenate([r1.prompt_ids, r1.completion_ids, prompt(6, 20)]).astype(np.int32)
        follow = req("t2", 0, 21, session="s", ids=follow_ids, temperature=0.8, max_tokens=10)
        r2 = generate(engine, [follow])[0]
        assert r2.prefix_reused == len(r1.prompt_ids) + len(r1.completion_ids) - 1
        assert engine.stats()["reused_tokens"] >= r2.prefix_reused
        no_reuse = generate(self.make_engine(model), [req("t2", 0, 21, ids=follow_ids, temperature=0.8, max_tokens=10)])[0]
        assert no_reuse.prefix_reused == 0
        assert_same(no_reuse, r2)
        # A prompt that leaves the session's history early reuses only the shared part.
        branch_ids = np.concatenate([follow_ids[:5], prompt(9, 22)]).astype(np.int32)
        if branch_ids[5] == follow_ids[5]:
            branch_ids[5] = (branch_ids[5] + 1) % 256
        r3 = generate(engine, [req("t3", 0, 23, session="s", ids=branch_ids, max_tokens=6)])[0]
        assert r3.prefix_reused == 5
        assert_same(generate(self.make_engine(model), [req("t3", 0, 23, ids=branch_ids, max_tokens=6)])[0], r3)

    # 8. KV memory: shared prefixes, preemption, long contexts

    def test_concurrent_branches_share_a_prefix(self, model):
        # Two requests of one session run together off one retained history: one extends it, one
        # leaves it mid-way (the partly matching KV is copied before it is written). Neither may
        # see the other's tokens, and a third request afterwards still reuses the history.
        engine = self.make_engine(model)
        r1 = generate(engine, [req("h", 37, 90, session="s", temperature=0.9, max_tokens=12)])[0]
        history = np.concatenate([r1.prompt_ids, r1.completion_ids]).astype(np.int32)
        extend = np.concatenate([history, prompt(7, 91)]).astype(np.int32)
        branch = np.concatenate([history[:21], prompt(30, 92)]).astype(np.int32)
        if branch[21] == history[21]:
            branch[21] = (branch[21] + 1) % 256
        both = generate(engine, [req("x", 0, 93, session="s", ids=extend, max_tokens=20),
                                 req("y", 0, 94, session="s", ids=branch, max_tokens=20)])
        assert [r.prefix_reused for r in both] == [len(history) - 1, 21]
        again = generate(engine, [req("z", 0, 95, session="s", ids=extend, max_tokens=9)])[0]
        assert again.prefix_reused > 0
        for r, ids in zip([*both, again], [extend, branch, extend]):
            fresh = generate(self.make_engine(model), [GenerationRequest(r.request_id, ids, SamplingParams(
                temperature=1.0, max_tokens=len(r.completion_ids), seed={"x": 93, "y": 94, "z": 95}[r.request_id]))])[0]
            assert_same(fresh, r)

    def test_preemption_resumes_exactly(self, model):
        # KV memory for about three of six requests: some must be preempted mid-decode and resumed.
        requests = [req(f"p{i}", 30 + 7 * i, 110 + i, temperature=1.0, max_tokens=60) for i in range(6)]
        alone = [generate(self.make_engine(model), [r])[0] for r in requests]
        engine = self.make_engine_with_memory(model, tokens=300)
        for a, b in zip(alone, generate(engine, requests)):
            assert_same(a, b)
        if self.preempts:
            assert engine.stats()["preempted"] > 0
        assert engine.stats()["live"] == engine.stats()["waiting"] == 0

    def test_long_prompt_does_not_stall_others(self, long_model):
        # A short request submitted while a long prompt is being prefilled gets its tokens first.
        engine = self.make_engine(long_model, max_seq_len=131072, prefill_step_tokens=2048)
        long = engine.submit(req("long", 16384, 120, max_tokens=1))
        engine.step()
        short = engine.submit(req("short", 8, 121, max_tokens=4))
        steps = 0
        while not short.done():
            engine.step()
            steps += 1
        assert not long.done()
        run_all(engine, [long])
        assert long.result().finish_reason == "length" and steps < 8

    def test_prompt_of_128k_tokens_completes(self, long_model):
        ids = prompt(131072 - 8, 130)
        engine = self.make_engine(long_model, max_seq_len=131072, max_batch=2)
        r = generate(engine, [GenerationRequest("huge", ids, SamplingParams(temperature=1.0, max_tokens=6, seed=1))])[0]
        assert len(r.prompt_ids) == 131064 and len(r.completion_ids) == 6
        assert np.isfinite(r.logprobs).all() and (r.logprobs <= 0).all()
        assert engine.stats()["prefill_tokens"] == 131064

    def test_live_request_of_64k_tokens_migrates_exactly(self, long_model):
        target = req("far", 65536, 140, temperature=1.0, max_tokens=12)
        reference = generate(self.make_engine(long_model, max_seq_len=70000), [target])[0]
        src = self.make_engine(long_model, max_seq_len=70000, name="src")
        fut = src.submit(target)
        while src.stats()["tokens_generated"] < 3:
            src.step()
        state = pickle.loads(pickle.dumps(src.export_request("far")))
        assert state.num_cached == 65536 + len(state.completion_ids) - 1
        dst = self.make_engine(long_model, max_seq_len=70000, name="dst")
        moved = run_all(dst, [dst.import_request(state)])[0]
        assert_same(reference, moved)
        with pytest.raises(RequestExported):
            fut.result(timeout=0)

    def test_request_over_the_context_is_refused_alone(self, model):
        engine = self.make_engine(model, max_seq_len=128)
        running = engine.submit(req("ok", 10, 150, max_tokens=8))
        with pytest.raises(ValueError, match="128"):
            engine.submit(req("over", 128, 151))
        with pytest.raises(ValueError, match="positions"):
            self.make_engine(model, max_seq_len=TINY.max_position_embeddings + 1)
        assert run_all(engine, [running])[0].finish_reason == "length"

    def test_tokens_stream_as_they_are_sampled(self, model):
        streamed: list[tuple[int, float]] = []
        r = req("stream", 9, 180, temperature=1.0, max_tokens=40)
        r.on_token = lambda tok, lp: streamed.append((tok, lp))
        engine = self.make_engine(model)
        fut = engine.submit(r)
        for _ in range(3):
            engine.step()
        assert 1 <= len(streamed) < 40 and not fut.done()  # tokens arrive before the request ends
        result = run_all(engine, [fut])[0]
        assert [t for t, _ in streamed] == result.completion_ids.tolist()
        np.testing.assert_array_equal(np.asarray([lp for _, lp in streamed], np.float32), result.logprobs)

    def test_imported_request_streams_the_tokens_after_the_move(self, model):
        before: list[int] = []
        after: list[int] = []
        r = req("stream-moving", 9, 181, temperature=1.0, max_tokens=30)
        r.on_token = lambda tok, lp: before.append(tok)
        src = self.make_engine(model, name="src")
        src.submit(r)
        for _ in range(4):
            src.step()
        state = src.export_request("stream-moving")
        assert before == state.completion_ids.tolist() and before  # nothing streamed that did not happen
        dst = self.make_engine(model, name="dst")
        result = run_all(dst, [dst.import_request(state, on_token=lambda tok, lp: after.append(tok))])[0]
        assert len(after) == 30 - len(before)
        assert before + after == result.completion_ids.tolist()

    # 9. constrained decoding

    def test_constraint_holds_from_an_untrained_policy(self, model):
        import json as _json

        template = _json.dumps([{"choice": ['go", "arguments": ', 'open", "arguments": ']}, {"json_object": True},
                                {"literal": "}</tool_call>"}, {"end": 257}])
        engine = self.make_engine(model)
        requests = [GenerationRequest(f"c{i}", prompt(12, 190 + i), SamplingParams(
            temperature=1.0 + 0.1 * (i % 4), max_tokens=34 + 6 * i, seed=i, stop_token_ids=(257,), constraint=template))
            for i in range(12)]
        for req_, r in zip(requests, generate(engine, requests)):
            assert r.finish_reason == "stop" and r.completion_ids[-1] == 257
            text = bytes(r.completion_ids[:-1].tolist()).decode()
            assert text.endswith("}</tool_call>")
            call = _json.loads('{"name": "' + text[: -len("</tool_call>")])
            assert call["name"] in {"go", "open"} and isinstance(call["arguments"], dict)
            # The behaviour log-probs are those of the masked distribution: never below the
            # unconstrained ones (masking only removes mass from other tokens).
            free = hf_logprobs(model, r, req_.params.temperature)
            assert (r.logprobs <= 1e-6).all() and (r.logprobs >= free - 1e-4).all()

    def test_constrained_request_moves_exactly(self, model):
        import json as _json

        template = _json.dumps([{"json_object": True}, {"end": 257}])
        target = GenerationRequest("cm", prompt(9, 200), SamplingParams(temperature=1.2, max_tokens=60, seed=5,
                                                                        stop_token_ids=(257,), constraint=template))
        reference = generate(self.make_engine(model), [target])[0]
        src = self.make_engine(model)
        src.submit(target)
        for _ in range(6):
            src.step()
        state = pickle.loads(pickle.dumps(src.export_request("cm")))
        assert 0 < len(state.completion_ids) < len(reference.completion_ids)
        dst = self.make_engine(model)
        assert_same(reference, run_all(dst, [dst.import_request(state)])[0])
        with pytest.raises(ValueError, match="constraint"):
            dst.submit(GenerationRequest("bad", prompt(3, 1), SamplingParams(constraint="[{\"nope\": 1}]")))
        with pytest.raises(ValueError, match="cannot hold"):
            dst.submit(GenerationRequest("short", prompt(3, 1), SamplingParams(max_tokens=2, constraint=template)))

    # 10. serving from threads

    def test_runner_serves_threads(self, model):
        requests = [[req(f"w{t}-{i}", 3 + 2 * i + t, 100 * t + i, max_tokens=4 + i % 5) for i in range(8)] for t in range(4)]
        reference_engine = self.make_engine(model)
        reference = {r.request_id: generate(reference_engine, [r])[0] for group in requests for r in group}
        engine = self.make_engine(model, max_batch=8)
        results: dict[str, GenerationResult] = {}
        lock = threading.Lock()

        def client(group):
            futures = []
            for r in group:
                futures.append(engine.submit(r))
                time.sleep(0.001)
            for f in futures:
                res = f.result(timeout=60)
                with lock:
                    results[res.request_id] = res

        with EngineRunner(engine) as runner:
            threads = [threading.Thread(target=client, args=(g,)) for g in requests]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert runner.running
        assert not runner.running and not runner.errors
        assert len(results) == 32
        for rid, res in results.items():
            assert_same(reference[rid], res)
        assert engine.stats()["live"] == 0

    def test_runner_moves_live_request(self, model, model_b):
        target = req("long", 12, 24, temperature=1.0, max_tokens=1000)
        reference = generate(self.make_engine(model, max_seq_len=512), [target])[0]
        src = self.make_engine(model, name="src", max_seq_len=512)
        dst = self.make_engine(model, name="dst", max_seq_len=512)
        # Every runner step waits 10 ms until the export, so ~500 tokens take seconds: the export
        # lands mid-flight even when this thread is descheduled for a while on a busy box.
        FAULTS.arm("engine_step", 10**6, delay_s=0.01)
        try:
            with EngineRunner(src) as a, EngineRunner(dst):
                fut = a.submit(target)
                deadline = time.monotonic() + 30
                while src.stats()["tokens_generated"] < 3 and time.monotonic() < deadline:
                    time.sleep(0.001)
                state = a.export_request("long")
                FAULTS.arm("engine_step", 0)
                moved = dst.import_request(state).result(timeout=60)
        finally:
            FAULTS.arm("engine_step", 0)
        with pytest.raises(RequestExported):
            fut.result(timeout=0)
        assert len(state.completion_ids) >= 3
        assert_same(reference, moved)


class TestTorchEngine(EngineTests):
    """Paged, with blocks of 8 positions: every test crosses block boundaries many times."""

    supports_logits_hook = True
    device = "cpu"
    block = 8

    def make_engine(self, model, **kwargs):
        kwargs.setdefault("max_seq_len", 256)
        kwargs.setdefault("kv_block_size", self.block)
        return TorchEngine(model, device=self.device, **kwargs)

    def make_engine_with_memory(self, model, tokens: int, **kwargs):
        return self.make_engine(model, kv_blocks=tokens // self.block, **kwargs)

    def test_paged_equals_one_slot_per_request(self, model):
        # Short and long contexts: decode attends in one batch, or row by row over block runs.
        for lengths in ([5 + 13 * i for i in range(5)], [260 + 13 * i for i in range(5)]):
            requests = [req(f"b{n}", n, 160 + n, temperature=1.0, max_tokens=70) for n in lengths]
            slots = generate(self.make_engine(model, kv_block_size=None, max_seq_len=512), requests)
            for a, b in zip(slots, generate(self.make_engine(model, max_seq_len=512), requests)):
                assert_same(a, b)

    def test_peak_live_tokens_fit_the_peak_live_blocks(self, model):
        lengths = (30, 45, 70)
        engine = self.make_engine(model, retain_sessions=0)
        results = generate(engine, [req(f"pk{n}", n, 200 + n, max_tokens=40) for n in lengths])
        s = engine.stats()
        blocks, tokens = s["kv_peak_live_blocks"], s["kv_peak_live_tokens"]
        # At the peak every request was live, each in its own blocks, rounded up by less than one.
        assert blocks <= sum(-(-(len(r.prompt_ids) + len(r.completion_ids) - 1) // self.block) for r in results)
        assert (blocks - len(lengths)) * self.block < tokens <= blocks * self.block + len(lengths)
        assert tokens <= sum(len(r.prompt_ids) + len(r.completion_ids) for r in results)

    def test_blocks_are_freed_and_shared(self, model):
        engine = self.make_engine(model, retain_sessions=1)
        first = generate(engine, [req("f", 40, 170, session="s", max_tokens=9)])[0]
        held = engine.stats()["kv_blocks_used"]  # the retained session's blocks
        assert held == -(-(len(first.prompt_ids) + len(first.completion_ids) - 1) // self.block)
        ids = np.concatenate([first.prompt_ids, first.completion_ids]).astype(np.int32)
        engine.submit(req("g", 0, 171, session="s", ids=ids, max_tokens=30))
        engine.step()
        # The follow-up shares every whole block of the history and takes one more for its tail.
        assert engine.stats()["kv_blocks_used"] == held + 1
        engine.drain()
        generate(engine, [req("other", 10, 172, max_tokens=3)])  # no session: nothing retained
        assert engine.stats()["kv_blocks_used"] == -(-(len(ids) + 30 - 1) // self.block)

    def test_chunked_and_grouped_prefill(self, model):
        alone = [generate(self.make_engine(model), [r])[0] for r in mixed_requests()]
        engine = self.make_engine(model, prefill_chunk=4, prefill_batch_tokens=12)
        for a, b in zip(alone, generate(engine, mixed_requests())):
            assert_same(a, b)

    def test_batched_prefill_of_sessions_with_different_cached_prefixes(self, model):
        # Four sessions with different histories come back together: one prefill batch whose rows
        # reuse cached prefixes of different lengths and feed different numbers of new tokens.
        engine = self.make_engine(model, retain_sessions=4)
        firsts = generate(engine, [req(f"s{i}a", 5 + 9 * i, 40 + i, session=f"s{i}", max_tokens=3 + i) for i in range(4)])
        follows = []
        for i, r in enumerate(firsts):
            ids = np.concatenate([r.prompt_ids, r.completion_ids, prompt(2 + 11 * i, 50 + i)]).astype(np.int32)
            follows.append(req(f"s{i}b", 0, 60 + i, session=f"s{i}", ids=ids, temperature=0.9, max_tokens=6))
        before = engine.stats()["iterations"]
        together = generate(engine, follows)
        reused = [r.prefix_reused for r in together]
        assert len(set(reused)) == 4 and min(reused) > 0
        assert engine.stats()["iterations"] - before <= 7  # admitted and prefilled in one iteration
        for f, r in zip(follows, together):
            fresh = GenerationRequest(f.request_id, f.prompt_ids, f.params)  # no session: no reuse
            assert_same(generate(self.make_engine(model), [fresh])[0], r)

    def test_prefill_groups_of_scattered_rows(self, model):
        # Grouping by length splits rows admitted together, so groups gather keys by block table.
        requests = [req(f"g{i}", n, 70 + i, max_tokens=5) for i, n in enumerate([5, 30, 6, 31])]
        alone = [generate(self.make_engine(model), [r])[0] for r in requests]
        engine = self.make_engine(model, prefill_batch_tokens=64)
        for a, b in zip(alone, generate(engine, requests)):
            assert_same(a, b)

    def test_stale_sessions_are_dropped(self, model, model_b):
        engine = self.make_engine(model, retain_sessions=1)
        r1 = generate(engine, [req("a1", 10, 30, session="a", max_tokens=4)])[0]
        ids = np.concatenate([r1.prompt_ids, r1.completion_ids]).astype(np.int32)
        # A second session evicts the first from the single retained slot.
        generate(engine, [req("b1", 10, 31, session="b", max_tokens=4)])
        assert generate(engine, [req("a2", 0, 32, session="a", ids=ids, max_tokens=4)])[0].prefix_reused == 0
        # KV from older weights is never reused.
        r3 = generate(engine, [req("a3", 0, 33, session="a", ids=ids, max_tokens=4)])[0]
        assert r3.prefix_reused > 0
        engine.load_weights(state_dict_numpy(model_b), version=2)
        r4 = generate(engine, [req("a4", 0, 33, session="a", ids=ids, max_tokens=4)])[0]
        assert r4.prefix_reused == 0 and (r4.versions == 2).all()

    def test_rejects_bad_requests(self, model):
        engine = self.make_engine(model)
        with pytest.raises(ValueError):
            engine.submit(req("e", 0, 0, ids=np.zeros(0, np.int32)))
        with pytest.raises(ValueError):
            engine.submit(req("big", 300, 0))
        with pytest.raises(ValueError):
            engine.submit(req("tok", 0, 0, ids=np.array([999], np.int32)))
        engine.submit(req("dup", 3, 0))
        with pytest.raises(ValueError):
            engine.submit(req("dup", 3, 0))

    def test_sequence_capped_by_cache(self, model):
        r = generate(self.make_engine(model, max_seq_len=32), [req("cap", 20, 34, max_tokens=100)])[0]
        assert r.finish_reason == "length" and len(r.prompt_ids) + len(r.completion_ids) == 32


class TestTorchEngineSlots(EngineTests):
    """One block of ``max_seq_len`` per request: the slot layout, as a reference and a baseline.
    A request holds its whole sequence's memory from admission, so it never has to be preempted."""

    supports_logits_hook = True
    preempts = False

    def make_engine(self, model, **kwargs):
        kwargs.setdefault("max_seq_len", 256)
        return TorchEngine(model, kv_block_size=None, **kwargs)

    def make_engine_with_memory(self, model, tokens: int, **kwargs):
        kwargs.setdefault("max_seq_len", 128)
        return self.make_engine(model, kv_blocks=max(1, tokens // kwargs["max_seq_len"]), **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
class TestTorchEngineCuda(TestTorchEngine):
    device = "cuda"
