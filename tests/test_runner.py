"""The engine runner's fault point ``engine_step``: a paused or failed step changes no token."""

from __future__ import annotations

import numpy as np
import pytest

from gyreflow.engine.base import GenerationRequest, SamplingParams
from gyreflow.engine.runner import EngineRunner
from gyreflow.engine.torch_engine import TorchEngine
from gyreflow.faults import FAULTS, POINTS
from gyreflow.model import ModelConfig, build_policy

TINY = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2)


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread(one_torch_thread):
    pass


@pytest.fixture(autouse=True)
def _disarmed():
    yield
    FAULTS.arm("engine_step", 0)


def request(rid: str) -> GenerationRequest:
    ids = np.random.default_rng(7).integers(0, 256, size=9).astype(np.int32)
    return GenerationRequest(rid, ids, SamplingParams(temperature=1.0, max_tokens=24, seed=3))


def run(times: int, delay_s: float):
    model = build_policy(TINY, seed=0)
    engine = TorchEngine(model, max_batch=4, max_seq_len=64)
    before = FAULTS.count().get("engine_step", 0)
    if times:
        FAULTS.arm("engine_step", times, delay_s)
    with EngineRunner(engine) as runner:
        result = runner.submit(request("r")).result(timeout=60)
    return result, FAULTS.count().get("engine_step", 0) - before, runner.errors


def test_paused_and_failed_steps_generate_the_same_tokens():
    plain, fired, errors = run(0, 0.0)
    assert fired == 0 and not errors and len(plain.completion_ids) == 24
    slow, fired, errors = run(5, 0.002)  # each of the first five steps waits, then runs
    assert fired == 5 and not errors
    np.testing.assert_array_equal(slow.completion_ids, plain.completion_ids)
    failed, fired, errors = run(2, 0.0)  # two steps fail before the engine runs them: logged, retried
    assert fired == 2 and [type(e).__name__ for e in errors] == ["InjectedFault"] * 2
    np.testing.assert_array_equal(failed.completion_ids, plain.completion_ids)
    np.testing.assert_allclose(failed.logprobs, plain.logprobs, atol=1e-6)


def test_engine_step_is_not_a_move_point():
    assert "engine_step" not in POINTS
    with pytest.raises(ValueError, match="unknown fault point 'engine_stepp'.*engine_step"):
        FAULTS.arm("engine_stepp")
