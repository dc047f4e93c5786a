import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "error")

import pytest

# A run small enough for a test: tiny model, a few demonstrations, short tasks.
TINY_OVERRIDES = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_layers=1",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "sft.demos=24",
    "sft.steps=4",
    "task.horizon=2",
    "task.spare_calls=1",
    "task.heldout_tasks=4",
    "rl.steps=2",
    "rl.tasks_per_step=2",
    "rl.samples_per_task=2",
    "agent.max_tokens_per_call=8",
    "agent.max_context_tokens=256",
    "cluster.execution_slots=8",
    "cluster.engine_max_batch=8",
    # One rollout and one trainer cell, kept as they are; tests of placement set their own.
    "cluster.placement=async",
    "cluster.rollout_workers=1",
]


@pytest.fixture(scope="module")
def one_torch_thread():
    """The tiny models gain nothing from intra-op threads, and they stall on a busy CPU box."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny_overrides():
    return list(TINY_OVERRIDES)
