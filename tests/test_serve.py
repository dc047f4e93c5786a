"""``gyreflow serve``: a real process over a checkpoint, driven with the official SDK, stopped with
Ctrl-C; the archive holds each session's calls, token-exact."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from gyreflow.model import build_policy, save_policy
from gyreflow.model.policy import LONG_CONTEXT
from gyreflow.storage import ArchiveReader
from proxy_support import SMALL


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    save_policy(build_policy(SMALL, seed=1), path)
    return path


def start(checkpoint, out, *args):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "gyreflow.cli", "serve", "--checkpoint", str(checkpoint),
                             "--out", str(out), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines = []
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("archive:"):
            return proc, "".join(lines)
    proc.kill()
    raise AssertionError("gyreflow serve did not start:\n" + "".join(lines) + proc.stdout.read())


def test_serve_records_sessions_and_commits_on_ctrl_c(checkpoint, tmp_path):
    proc, banner = start(checkpoint, tmp_path / "run", "--sessions", "2", "--max-tokens-per-call", "8")
    try:
        sessions = re.findall(r"session (\S+): OPENAI_BASE_URL=(\S+) OPENAI_API_KEY=(\S+)", banner)
        assert len(sessions) == 2 and all("127.0.0.1" in url for _, url, _ in sessions)
        admin = re.search(r"admin key: (\S+)", banner).group(1)
        root = re.search(r"at (http://\S+)", banner).group(1)
        ids = {}
        for eid, url, key in sessions:
            c = openai.OpenAI(base_url=url, api_key=key)
            outs = [c.chat.completions.create(model="gyreflow-policy", messages=[{"role": "user", "content": f"{eid} {i}"}],
                                              extra_body={"return_token_ids": True}) for i in range(2)]
            ids[eid] = [o.model_extra["token_ids"] for o in outs]
        # A third session through the admin route, closed (and written) before the stop.
        req = urllib.request.Request(f"{root}/gyreflow/sessions", method="POST", data=b"",
                                     headers={"Authorization": f"Bearer {admin}"})
        opened = json.loads(urllib.request.urlopen(req).read())
        c = openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"])
        c.completions.create(model="gyreflow-policy", prompt="abc", max_tokens=4)
        req = urllib.request.Request(f"{root}/gyreflow/sessions/{opened['execution_id']}", method="DELETE",
                                     headers={"Authorization": f"Bearer {admin}"})
        assert json.loads(urllib.request.urlopen(req).read())["calls"] == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0).completions.create(
                model="gyreflow-policy", prompt="abc", max_tokens=4)
        bad = urllib.request.Request(f"{root}/gyreflow/sessions", method="POST", data=b"",
                                     headers={"Authorization": "Bearer wrong"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(bad)
        assert err.value.code == 401
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "3 executions committed" in out
    reader = ArchiveReader(tmp_path / "run" / "archive.zarr")
    assert reader.committed_steps == [0]
    got = {}
    for eid in [e for e, _, _ in sessions] + [opened["execution_id"]]:
        ex = reader.load_execution(0, eid)
        got[eid] = [c.completion_ids.tolist() for c in ex.calls]
    for eid, _, _ in sessions:
        assert got[eid] == ids[eid]
    assert len(got[opened["execution_id"]]) == 1


def test_serve_refuses_a_bad_checkpoint(tmp_path):
    out = subprocess.run([sys.executable, "-m", "gyreflow.cli", "serve", "--checkpoint", str(tmp_path / "none"),
                          "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not a checkpoint directory" in out.stdout
    assert not (tmp_path / "run" / "archive.zarr").exists()


def test_serve_on_a_busy_port_leaves_nothing_behind(checkpoint, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "gyreflow.cli", "serve", "--checkpoint", str(checkpoint),
                              "--out", str(tmp_path / "run"), "--port", str(port)],
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "error" in out.stdout
    assert not (tmp_path / "run" / "archive.zarr").exists()


def test_serve_takes_a_long_first_prompt_with_tools(tmp_path):
    """Engines are sized from the model's positions: a first prompt of 9K tokens with tool
    schemas (what agent frameworks send) is served, not refused."""
    ckpt = save_policy(build_policy(LONG_CONTEXT, seed=1), tmp_path / "long")
    proc, banner = start(ckpt, tmp_path / "run", "--max-tokens-per-call", "8")
    try:
        assert "context 131,072 tokens" in banner
        _, url, key = re.findall(r"session (\S+): OPENAI_BASE_URL=(\S+) OPENAI_API_KEY=(\S+)", banner)[0]
        tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 200,
                                                   "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
                 for i in range(8)]
        system = "You are an agent. " + "Follow the rules. " * 400
        reply = openai.OpenAI(base_url=url, api_key=key, max_retries=0).chat.completions.create(
            model="gyreflow-policy", messages=[{"role": "system", "content": system}, {"role": "user", "content": "go"}],
            tools=tools, max_tokens=8)
        assert reply.usage.prompt_tokens > 9000 and reply.choices
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out


def test_serve_refuses_a_context_beyond_the_model(checkpoint, tmp_path):
    out = subprocess.run([sys.executable, "-m", "gyreflow.cli", "serve", "--checkpoint", str(checkpoint),
                          "--out", str(tmp_path / "run"), "--max-context", str(SMALL.max_position_embeddings + 1)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--max-context" in out.stdout and "positions" in out.stdout
    assert not (tmp_path / "run" / "archive.zarr").exists()
