"""The vault task suite, its grader, the native agent loop and the demonstrator."""

import numpy as np
import pytest

from gyreflow.agents.demos import Demonstrator, DemoNoise, demonstrations
from gyreflow.agents.loop import AgentConfig, run_agent
from gyreflow.agents.tasks import VaultEnv, inscription, make_task, make_tasks, parse_tool_call
from gyreflow.engine.base import GenerationResult
from gyreflow.model.chat import END_ID, encode_text
from gyreflow.trajectory.tree import build_tree

PERFECT = DemoNoise(p_skip_read=0.0, p_right_explicit=1.0, p_right_compare=1.0, p_malformed=0.0)


def scripted(texts):
    """A generate function that answers with ``texts`` in turn (then repeats the last)."""
    it = iter(texts)
    last = [texts[-1]]

    def generate(req):
        text = next(it, last[0])
        ids = np.array(encode_text(text) + [END_ID], np.int32)
        return GenerationResult(req.request_id, req.prompt_ids, ids, np.zeros(len(ids), np.float32),
                                np.zeros(len(ids), np.int32), "stop", "scripted")

    return generate


def test_tasks_are_deterministic_and_splits_disjoint():
    assert make_task("train", 3, 5) == make_task("train", 3, 5)
    train = {t.rooms for t in make_tasks("train", 300, 4)}
    heldout = {t.rooms for t in make_tasks("heldout", 300, 4)}
    assert not train & heldout
    task = make_task("train", 0, 7, spare_calls=2)
    assert task.horizon == 7 and task.max_calls == 16


def test_grader_gives_partial_credit_and_tools_report_errors():
    task = make_task("heldout", 1, 3)
    env = VaultEnv(task)
    room = task.rooms[0]
    assert env.execute("read()") == f"note: {room.note}"
    wrong = next(d for d in "abc" if d != room.answer)
    assert env.execute(f"go({wrong})") == "locked"
    assert env.execute(f"go({room.answer})").startswith("room 2/3")
    assert env.grade() == (pytest.approx(1 / 3), False)
    assert env.execute("go 1").startswith("error: malformed tool call")
    assert env.execute("fly(a)").startswith("error: unknown tool 'fly'")
    assert env.execute("go(z)").startswith("error: no door 'z'")
    m = env.metrics()
    assert m["malformed"] == 3 and m["wrong_doors"] == 1 and m["tool_calls"] == 6


def test_parse_tool_call():
    assert parse_tool_call(" go(b) ") == ("go", "b")
    assert parse_tool_call("read()") == ("read", "")
    with pytest.raises(ValueError, match="malformed"):
        parse_tool_call("go b")


def test_malformed_call_is_an_observation_not_a_crash():
    task = make_task("heldout", 2, 1)
    answer = task.rooms[0].answer
    result = run_agent(task, scripted(["gibberish", "read()", f"go({answer})"]), AgentConfig(), "x")
    assert result.passed and result.reward == 1.0 and result.end_reason == "done"
    assert result.metrics["malformed"] == 1
    # The error message went back to the agent: it is in the next call's prompt.
    second_prompt = bytes(int(t) for t in result.calls[1].prompt_ids if t < 256).decode()
    assert "error: malformed tool call 'gibberish'" in second_prompt


def test_budgets_end_executions_with_partial_grades():
    task = make_task("heldout", 3, 4, spare_calls=0)
    out = run_agent(task, scripted(["read()"]), AgentConfig(), "calls")
    assert out.end_reason == "budget" and len(out.calls) == task.max_calls and out.reward == 0.0
    out = run_agent(task, scripted(["read()"]), AgentConfig(token_budget=20), "tokens")
    assert out.end_reason == "budget" and out.tokens_generated >= 20
    out = run_agent(task, scripted(["read()"]), AgentConfig(time_limit_s=0.0), "time")
    assert out.end_reason == "time_limit" and out.calls == []


def test_engine_failure_ends_the_execution_as_an_infrastructure_failure():
    task = make_task("heldout", 4, 2)

    def broken(req):
        raise ConnectionError("engine went away")

    out = run_agent(task, broken, AgentConfig(), "crash")
    assert out.end_reason == "infra_failure" and "engine went away" in out.metrics["error"] and out.reward == 0.0
    assert out.dropped


def test_prompts_extend_previous_calls_token_exactly():
    task = make_task("train", 5, 3)
    out = run_agent(task, Demonstrator(task, PERFECT, np.random.default_rng(0)), AgentConfig(), "chain")
    assert out.passed
    for prev, cur in zip(out.calls, out.calls[1:]):
        head = np.concatenate([prev.prompt_ids, prev.completion_ids])
        assert np.array_equal(cur.prompt_ids[: len(head)], head)
    tree = build_tree(out)
    assert tree.n_leaves == 1


def test_long_horizon_with_compaction_reaches_200_tool_calls():
    task = make_task("train", 6, 100)
    cfg = AgentConfig(max_context_tokens=512, keep_turns=4)
    out = run_agent(task, Demonstrator(task, PERFECT, np.random.default_rng(0)), cfg, "long")
    assert out.passed and len(out.calls) >= 200
    assert out.metrics["compactions"] > 0
    assert max(len(c.prompt_ids) for c in out.calls) <= 512
    # Compaction drops old turns, so the calls no longer form one chain: the tree branches.
    assert build_tree(out).n_leaves > 1


def test_reply_padding_starts_every_tool_reply_and_is_deterministic():
    plain, padded = make_task("train", 8, 3), make_task("train", 8, 3, reply_padding=200)
    assert plain.rooms == padded.rooms
    a, b, c = VaultEnv(plain), VaultEnv(padded), VaultEnv(padded)
    for call in ["read()", "go 1", f"go({plain.rooms[0].answer})", "read()"]:
        short, long_, again = a.execute(call), b.execute(call), c.execute(call)
        assert long_ == again
        pad, rest = long_.split("\n", 1)
        assert len(pad) == 200 and rest == short
    # Different calls get different inscriptions; the grade ignores the padding.
    assert inscription(padded.task_id, 1, 200) != inscription(padded.task_id, 2, 200)
    assert a.grade() == b.grade() == (pytest.approx(1 / 3), False)


def test_long_replies_make_200_calls_and_100k_tokens_without_compaction():
    """The long real setting: 100 rooms, 500 characters per reply. Every prompt extends the last
    one, so the execution is one chain of >= 100K tokens."""
    task = make_task("train", 9, 100, reply_padding=500)
    cfg = AgentConfig(max_context_tokens=130_000)
    out = run_agent(task, Demonstrator(task, PERFECT, np.random.default_rng(0)), cfg, "long")
    assert out.passed and len(out.calls) >= 200 and out.metrics["compactions"] == 0
    assert len(out.calls[-1].prompt_ids) >= 100_000
    tree = build_tree(out)
    assert tree.n_leaves == 1


def test_demonstrator_is_imperfect_but_competent():
    demos = demonstrations(make_tasks("sft", 200, 4), AgentConfig(), DemoNoise(), seed=0)
    rate = np.mean([d.passed for d in demos])
    assert 0.3 < rate < 0.98
    assert all(d.calls and d.calls[0].role == "demo" for d in demos)


def test_a_grader_that_raises_ends_the_execution_as_a_grader_failure(monkeypatch):
    from gyreflow.agents import loop

    def broken(self):
        raise OSError("disk went away")

    monkeypatch.setattr(loop.VaultEnv, "grade", broken)
    out = run_agent(make_task("heldout", 4, 2), lambda req: (_ for _ in ()).throw(ConnectionError("x")),
                    AgentConfig(), "grader")
    assert out.end_reason == "grader_failure" and out.dropped and "disk went away" in out.metrics["error"]
    assert out.reward == 0.0 and not out.passed


def test_compaction_keeps_every_prompt_inside_the_context_even_with_long_turns():
    """Turns longer than ``max_context_tokens / keep_turns``: a compacted prompt keeps only the
    latest turns that fit, so the engine is never sent more than the context the agent was cut for."""
    task = make_task("heldout", 7, 3, spare_calls=8)
    garbage = "nonsense " * 12  # a malformed call; its error observation repeats it
    cfg = AgentConfig(max_context_tokens=300, keep_turns=6)
    out = run_agent(task, scripted([garbage]), cfg, "long-turns")
    assert out.end_reason == "budget" and len(out.calls) == task.max_calls
    assert out.metrics["compactions"] > 0
    assert max(len(c.prompt_ids) for c in out.calls) <= 300
    # The latest observation is still there after a compaction.
    last = bytes(int(t) for t in out.calls[-1].prompt_ids if t < 256).decode()
    assert last.count("error: malformed tool call") >= 1
