"""Demonstrations for suite tasks: the agent program itself, its calls answered by the task's
reference solution through a real proxy, recorded token-exact in the policy's format."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from gyreflow.agents.external import ExternalAgent
from gyreflow.agents.sources import SuiteSource, VaultSource, task_source
from gyreflow.agents.suite import load_suite
from gyreflow.agents.teacher import DemoTools, suite_demonstrations
from gyreflow.config import ConfigError, load_config
from gyreflow.model import build_tokenizer
from gyreflow.proxy.calls import model_card
from gyreflow.trajectory.tree import build_tree

REPO = Path(__file__).resolve().parent.parent
AGENT = ExternalAgent(command=(sys.executable, str(REPO / "examples" / "openai_agent" / "agent.py")))


def test_example_agent_demonstrations_solve_and_record(tmp_path):
    tok = build_tokenizer()
    tasks = [t for t in load_suite(REPO / "examples" / "repo_tasks") if t.split == "train"]
    demos = suite_demonstrations(tasks, AGENT, model_card(tok))
    assert sorted(d.task_id for d in demos) == sorted(t.task_id for t in tasks)
    for d in demos:
        assert d.passed and d.reward == 1.0 and d.end_reason == "done"
        texts = [tok.decode(c.completion_ids) for c in d.calls]
        assert '"name": "write_file"' in texts[0] and '"name": "finish"' in texts[-1]
        # The program's history came back with the demonstrator's exact ids: one path per demo.
        assert len(build_tree(d).paths()) == 1
        first, second = d.calls[:2]
        np.testing.assert_array_equal(second.prompt_ids[: len(first.prompt_ids) + len(first.completion_ids)],
                                      np.concatenate([first.prompt_ids, first.completion_ids]))


def test_demonstrations_need_the_programs_tools():
    tasks = load_suite(REPO / "examples" / "repo_tasks")[:1]
    with pytest.raises(ValueError, match="offer the tools"):
        suite_demonstrations(tasks, AGENT, model_card(build_tokenizer()), DemoTools(write="save", finish="done"))


def test_task_sources():
    vault = task_source(load_config(None, ["task.heldout_tasks=3"]))
    assert isinstance(vault, VaultSource) and len(vault.heldout()) == 3 and vault.train(0, 2)[0].kind == "vault"
    cfg = load_config(None, ["task.suite=examples/repo_tasks"])
    suite = task_source(cfg)
    assert isinstance(suite, SuiteSource) and suite.agent() is cfg.external
    assert [t.task_id for t in suite.train(1, 3)] == ["largest", "add", "count_to"]  # round the suite
    assert {t.split for t in suite.heldout()} == {"heldout"}


def test_bad_suite_configs(tmp_path):
    (tmp_path / "only").mkdir()
    with pytest.raises(ConfigError, match="task.suite"):
        load_config(None, [f"task.suite={tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match="external"):
        load_config(None, ["external.command=[]"])
    with pytest.raises(ConfigError, match="external.env"):
        load_config(None, ['external.env={"A": 1}'])


REQUIRED_AGENT = '''
import json, os, openai
c = openai.OpenAI()
tools = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object",
          "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}},
         {"type": "function", "function": {"name": "finish", "parameters": {"type": "object", "properties": {}}}}]
messages = [{"role": "user", "content": open("TASK.md").read()}]
for _ in range(4):
    r = c.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, tools=tools,
                                  tool_choice="required", max_tokens=300)
    m = r.choices[0].message
    messages.append(m.model_dump(exclude_none=True))
    for call in m.tool_calls or []:
        if call.function.name == "finish":
            raise SystemExit(0)
        args = json.loads(call.function.arguments)
        open(args["path"], "w").write(args["content"])
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "written"})
'''


def test_demonstrations_continue_a_forced_tool_call():
    """A program that demands a tool call (tool_choice=required): the prompt already holds the
    call's opening, and the demonstration continues it instead of writing it twice."""
    tok = build_tokenizer()
    tasks = [t for t in load_suite(REPO / "examples" / "repo_tasks") if t.task_id == "add"]
    agent = ExternalAgent(command=(sys.executable, "-c", REQUIRED_AGENT))
    (demo,) = suite_demonstrations(tasks, agent, model_card(tok))
    assert demo.passed and len(demo.calls) == 2
    forced = '<tool_call>{"name": "'
    for c in demo.calls:
        assert tok.decode(c.prompt_ids).endswith(forced)
        assert not tok.decode(c.completion_ids).startswith("<tool_call>")
