"""A long real execution through the proxy: >= 200 tool calls and >= 100K tokens of context, driven
by the official SDK against a real engine, with no compaction; its tree and its archive hold it
whole."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from gyreflow.agents.tasks import VaultEnv, make_task
from gyreflow.engine.runner import EngineRunner
from gyreflow.engine.torch_engine import TorchEngine
from gyreflow.model import build_policy, build_tokenizer
from gyreflow.model.policy import LONG_CONTEXT
from gyreflow.proxy.calls import model_card
from gyreflow.proxy.local import EngineBackend, ProxyThread
from gyreflow.proxy.sessions import Budget
from gyreflow.storage import ArchiveReader, archive_path, commit_step, create_archive, write_execution
from gyreflow.trajectory.records import ExecutionResult
from gyreflow.trajectory.tree import build_tree


@pytest.fixture(scope="module")
def long_engine(one_torch_thread):
    runner = EngineRunner(TorchEngine(build_policy(LONG_CONTEXT, seed=0), max_batch=4, retain_sessions=2)).start()
    yield runner
    runner.stop()


def test_a_200_call_100k_token_execution_through_the_proxy(long_engine, tmp_path):
    task = make_task("train", 9, 100, reply_padding=500)
    vault = VaultEnv(task)
    with ProxyThread(model_card(build_tokenizer(), "m")) as px:
        session = px.open("long", EngineBackend(long_engine), budget=Budget(max_calls=task.max_calls,
                                                                            max_tokens_per_call=8))
        env = px.environment(session)
        client = openai.OpenAI(base_url=env["OPENAI_BASE_URL"], api_key=env["OPENAI_API_KEY"])
        messages = [{"role": "user", "content": vault.prompt()}]
        for _ in range(task.max_calls):
            # The reply is the command; what the tool answers comes back as the next user turn.
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
            text = reply.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": vault.execute(text)}]
        records = px.close("long").records

    assert len(records) == task.max_calls >= 200
    assert len(records[-1].prompt_ids) >= 100_000
    # No compaction: every prompt is the previous prompt, its completion and the tool replies.
    for prev, cur in zip(records, records[1:]):
        head = np.concatenate([prev.prompt_ids, prev.completion_ids])
        np.testing.assert_array_equal(cur.prompt_ids[: len(head)], head)
    reward, passed = vault.grade()
    result = ExecutionResult(execution_id="long", task_id=task.task_id, step=0, sample=0, split="train",
                             calls=records, reward=reward, passed=passed, end_reason="budget")
    tree = build_tree(result)
    assert tree.n_leaves == 1
    assert tree.unique_tokens == len(records[-1].prompt_ids) + len(records[-1].completion_ids)

    archive = str(archive_path(tmp_path / "run"))
    create_archive(archive, {"config": {}})
    write_execution(archive, result)
    commit_step(archive, 0, {})
    back = ArchiveReader(archive).load_execution(0, "long")
    assert len(back.calls) == len(records)
    for a, b in zip(records, back.calls):
        np.testing.assert_array_equal(a.prompt_ids, b.prompt_ids)
        np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
        np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert build_tree(back).unique_tokens == tree.unique_tokens
