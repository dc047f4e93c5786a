"""External executions on a real local Dask cluster: agent programs run as subprocesses of the
execution worker, talk to its proxy with the official SDK, and their calls go through the router
to the engine on a rollout cell. Each recorded call is compared with the same request on an
in-process engine; each workspace is graded as the program left it."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from distributed import Client

from gyreflow.agents.external import ExternalAgent
from gyreflow.agents.loop import call_seed
from gyreflow.agents.suite import load_suite
from gyreflow.cluster.local import PoolSpec, cells_of, install, local_cluster
from gyreflow.cluster.pools import EXECUTION, ROLLOUT
from gyreflow.engine.base import GenerationRequest, SamplingParams
from gyreflow.engine.torch_engine import TorchEngine
from gyreflow.model import build_policy, build_tokenizer, state_dict_numpy
from gyreflow.model.chat import END_ID
from gyreflow.stages import publish_weights, run_execution
from gyreflow.train.state import PublishedWeights
from proxy_support import SMALL

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "examples" / "repo_tasks"
ENGINE_OPTIONS = {"max_batch": 8, "max_seq_len": 4096}
SLOT = {EXECUTION: 1}

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model(one_torch_thread):
    return build_policy(SMALL, seed=3)


@pytest.fixture(scope="module")
def client(model):
    with local_cluster(PoolSpec(rollout=1, trainer=1, execution_slots=4)) as cluster, Client(cluster) as c:
        c.wait_for_workers(3)
        install(c, torch_threads=1, engine_options=ENGINE_OPTIONS, mode="async")
        published = PublishedWeights(2, "external-test", model.config.to_dict(), state_dict_numpy(model))
        for cell in cells_of(c)[ROLLOUT]:
            c.submit(publish_weights, published, workers=[cell], pure=False).result()
        yield c


@pytest.fixture(scope="module")
def tasks():
    return {t.task_id: t for t in load_suite(SUITE)}


def program(code: str) -> tuple[str, ...]:
    """An agent program given as Python source (it imports only the official SDK)."""
    return (sys.executable, "-c", textwrap.dedent(code))


def check_against_reference(model, result, seed: int, max_tokens: int) -> None:
    """Each recorded call equals the same request on an engine in this process."""
    engine = TorchEngine(model, version=2, **ENGINE_OPTIONS)
    futures = []
    for rec in result.calls:
        index = int(rec.call_id.rsplit("/", 1)[1])
        params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, stop_token_ids=(END_ID,),
                                seed=call_seed(seed, result.execution_id, index))
        futures.append(engine.submit(GenerationRequest(rec.call_id, rec.prompt_ids, params)))
    while not all(f.done() for f in futures):
        engine.step()
    for rec, f in zip(result.calls, futures):
        ref = f.result()
        np.testing.assert_array_equal(rec.completion_ids, ref.completion_ids)
        np.testing.assert_allclose(rec.logprobs, ref.logprobs, atol=1e-4)
        assert set(rec.versions.tolist()) == {2}


def test_example_agent_runs_as_an_external_execution(client, model, tasks):
    agent = ExternalAgent(command=("{python}", str(REPO / "examples" / "openai_agent" / "agent.py")),
                          max_calls=4, max_tokens_per_call=24, env={"AGENT_MAX_TURNS": "3", "AGENT_MAX_TOKENS": "24"})
    fut = client.submit(run_execution, tasks["add"], agent, "ext-example-0", 0, 0, 11, key="ext-example-0",
                        resources=SLOT, pure=False)
    result = fut.result()
    assert 1 <= len(result.calls) <= 3, result.metrics
    assert result.end_reason in ("done", "policy_crash") and result.metrics["returncode"] is not None
    assert result.reward == 0.0 and not result.passed  # an untrained policy leaves add() unwritten
    assert [t["command"] for t in result.metrics["tests"]] == list(tasks["add"].tests)
    check_against_reference(model, result, seed=11, max_tokens=24)


def test_stream_from_a_remote_engine_carries_tokens_as_they_are_sampled(client, tasks, tmp_path):
    """The engine is on another worker: the program's stream still shows text while the call runs,
    and the pieces make up exactly the recorded completion."""
    arrivals = tmp_path / "arrivals.json"
    code = f"""
        import json, os, time, openai
        c = openai.OpenAI()
        t0, seen = time.monotonic(), []
        for ch in c.chat.completions.create(model=os.environ["OPENAI_MODEL"], max_tokens=400, stream=True,
                                            messages=[{{"role": "user", "content": "go on"}}],
                                            extra_body={{"ignore_eos": True}}):
            if ch.choices and ch.choices[0].delta.content:
                seen.append((time.monotonic() - t0, ch.choices[0].delta.content))
        json.dump(seen, open({str(arrivals)!r}, "w"))
    """
    result = client.submit(run_execution, tasks["add"], ExternalAgent(command=program(code), max_tokens_per_call=400),
                           "ext-stream", 0, 0, 3, key="ext-stream", resources=SLOT, pure=False).result()
    assert result.end_reason == "done" and len(result.calls) == 1, result.metrics
    rec = result.calls[0]
    assert len(rec.completion_ids) == 400
    seen = json.loads(arrivals.read_text())
    assert "".join(text for _, text in seen) == build_tokenizer().decode(rec.completion_ids, skip_special_tokens=True)
    assert len(seen) > 50 and seen[0][0] < 0.25 * seen[-1][0]


def test_workspace_is_graded_as_left(client, model, tasks):
    """A program that writes half a solution, with one model call: partial credit, one record."""
    code = """
        import os, openai
        c = openai.OpenAI()
        r = c.chat.completions.create(model=os.environ["OPENAI_MODEL"],
                                      messages=[{"role": "user", "content": open("TASK.md").read()}])
        open("calc.py", "w").write("def add(a, b):\\n    return a + b if a < 5 else 0\\n")
    """
    agent = ExternalAgent(command=program(code), max_tokens_per_call=16)
    result = client.submit(run_execution, tasks["add"], agent, "ext-partial", 0, 0, 5, key="ext-partial",
                           resources=SLOT, pure=False).result()
    assert result.end_reason == "done" and len(result.calls) == 1
    assert result.reward == pytest.approx(2 / 3) and not result.passed
    check_against_reference(model, result, seed=5, max_tokens=16)


def test_hanging_program_is_cut_and_graded(client, tasks, tmp_path):
    marker = tmp_path / "child.pid"
    code = f"""
        import os, subprocess, time, openai
        c = openai.OpenAI()
        c.completions.create(model=os.environ["OPENAI_MODEL"], prompt="abc", max_tokens=4)
        child = subprocess.Popen(["sleep", "300"], start_new_session=True)
        open({str(marker)!r}, "w").write(str(child.pid))
        open("calc.py", "w").write("def add(a, b):\\n    return a + b\\n")
        time.sleep(300)
    """
    task = replace(tasks["add"], time_limit_s=4.0)
    result = client.submit(run_execution, task, ExternalAgent(command=program(code)), "ext-hang", 0, 0, 1,
                           key="ext-hang", resources=SLOT, pure=False).result()
    assert result.end_reason == "time_limit" and result.metrics["timed_out"]
    assert result.reward == 1.0 and len(result.calls) == 1  # what it did before the cut counts
    pid = int(marker.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # nothing the program started outlives its execution


def test_crash_and_flood_end_the_execution_not_the_run(client, tasks):
    crash = ExternalAgent(command=program("raise SystemExit(3)"))
    flood = ExternalAgent(command=program("""
        import os, openai
        c = openai.OpenAI()
        while True:
            c.chat.completions.create(model=os.environ["OPENAI_MODEL"], max_tokens=2,
                                      messages=[{"role": "user", "content": "again"}])
    """), max_calls=5)
    futs = [client.submit(run_execution, tasks["greet"], agent, eid, 0, 0, 2, key=eid, resources=SLOT, pure=False)
            for agent, eid in ((crash, "ext-crash"), (flood, "ext-flood"))]
    crashed, flooded = client.gather(futs)
    assert crashed.end_reason == "policy_crash" and crashed.metrics["returncode"] == 3 and not crashed.calls
    assert not crashed.dropped and crashed.metrics["attempts"] == 1  # the policy's failure: graded, not retried
    assert crashed.reward == pytest.approx(0.5)  # graded as the workspace stands: half its tests pass as given
    assert flooded.end_reason == "budget" and len(flooded.calls) == 5
    assert flooded.metrics["calls_refused"]["budget"] >= 1


def test_executions_the_system_fails_are_retried_then_dropped_without_failing_anything(client, tasks, tmp_path):
    """An executor that raises (the task's workspace is gone) is re-run within the retry budget,
    then comes back as a zero-reward placeholder; the future succeeds, so its step goes on. A
    program that sabotages its checks is the policy's doing: graded, not dropped."""
    gone = replace(tasks["greet"], workspace=str(tmp_path / "missing"))
    workspace = tmp_path / "ws"
    (workspace / "checks").mkdir(parents=True)
    (workspace / "checks" / "t.sh").write_text("exit 0\n")
    # The program turns the protected folder into a file; grading puts the folder back.
    guarded = replace(tasks["greet"], workspace=str(workspace), protected=("checks/t.sh",),
                      tests=("bash checks/t.sh",), setup=())
    breaker = ExternalAgent(command=program("import shutil; shutil.rmtree('checks'); open('checks', 'w').write('x')"))
    futs = [client.submit(run_execution, gone, ExternalAgent(command=program("pass")), "ext-gone", 0, 0, 2, 1,
                          key="ext-gone", resources=SLOT, pure=False),
            client.submit(run_execution, guarded, breaker, "ext-sabotage", 0, 0, 2, 2, key="ext-sabotage",
                          resources=SLOT, pure=False)]
    infra, sabotage = client.gather(futs)
    assert infra.end_reason == "infra_failure" and infra.dropped and infra.metrics["attempts"] == 2
    assert "missing" in infra.metrics["error"] and infra.reward == 0.0 and infra.calls == []
    assert infra.execution_id == "ext-gone"
    assert sabotage.end_reason == "done" and not sabotage.dropped and sabotage.metrics["attempts"] == 1
    assert sabotage.reward == 1.0  # the protected check is back and passes
