"""A small coding agent for any OpenAI-compatible chat-completions server.

It knows nothing of gyreflow: it uses only the official ``openai`` SDK, and is configured only
through the environment:

- ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``: the server (read by the SDK itself);
- ``OPENAI_MODEL``: the model name (default ``gyreflow-policy``);
- ``AGENT_MAX_TOKENS`` (default 256), ``AGENT_TEMPERATURE`` (default 1.0),
  ``AGENT_MAX_TURNS`` (default 12), ``AGENT_MAX_RETRIES`` (default 2, the SDK's own default).

The task is read from ``TASK.md`` in the working directory, else from the first argument. The agent
works in the working directory with five tools (list, read and write files, run a shell command,
finish) and stops when it calls ``finish``, when it twice in a row answers without a tool call, after
``AGENT_MAX_TURNS`` model calls, or when the server answers with an error (exit status 1).

Usage: ``python agent.py ["task text"]``
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import openai

ROOT = Path.cwd().resolve()
RUN_TIMEOUT_S = 30
OUTPUT_CHARS = 2000

SYSTEM = (
    "You are a coding agent working in a small repository. Use the tools to look at the files, "
    "edit them and run commands. Call finish() when the task is done."
)
NUDGE = "Continue with a tool call; call finish() when the task is done."


def _tool(name, description, **params):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": d} for p, d in params.items()},
                "required": list(params),
            },
        },
    }


TOOLS = [
    _tool("list_files", "List the files of the working directory."),
    _tool("read_file", "Read a text file.", path="path relative to the working directory"),
    _tool("write_file", "Write a text file (replaces it).", path="path relative to the working directory",
          content="the whole new content of the file"),
    _tool("run", f"Run a shell command in the working directory ({RUN_TIMEOUT_S} s limit).",
          command="the shell command"),
    _tool("finish", "Say that the task is done."),
]


def inside(path):
    """``path`` resolved inside the working directory; refuses anything outside it."""
    target = (ROOT / path).resolve()
    if target != ROOT and ROOT not in target.parents:
        raise ValueError(f"{path!r} is outside the working directory")
    return target


def list_files():
    names = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = sorted(d for d in dirnames if d not in (".git", "__pycache__"))
        names += [str((Path(dirpath) / f).relative_to(ROOT)) for f in sorted(filenames)]
    return "\n".join(names[:200]) or "(no files)"


def read_file(path):
    return inside(path).read_text(errors="replace")[:20000]


def write_file(path, content):
    target = inside(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    return f"wrote {len(content)} characters to {path}"


def run(command):
    # Output goes to a file, not a pipe: a background process holding a pipe open would block us.
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(command, shell=True, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = f"exit code {proc.wait(timeout=RUN_TIMEOUT_S)}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = f"timed out after {RUN_TIMEOUT_S} s"
        out.seek(0)
        output = out.read().decode(errors="replace")[-OUTPUT_CHARS:]
    return f"{status}\n{output}"


def finish():
    return "done"


FUNCTIONS = {"list_files": list_files, "read_file": read_file, "write_file": write_file, "run": run,
             "finish": finish}


def parse_arguments(raw):
    """Tool-call arguments as a dict: a JSON object, possibly encoded twice, or already a dict."""
    args = raw if raw is not None else "{}"
    for _ in range(2):
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
    if not isinstance(args, dict):
        raise ValueError(f"arguments must be a JSON object, got {raw!r}")
    return args


def call_tool(name, raw_arguments):
    """The tool's result as text; a bad call gives an error message, never an exception."""
    if name not in FUNCTIONS:
        return f"error: unknown tool {name!r}; tools are {', '.join(FUNCTIONS)}"
    try:
        return str(FUNCTIONS[name](**parse_arguments(raw_arguments)))
    except Exception as exc:  # the model made a mistake: tell it, and go on
        return f"error: {type(exc).__name__}: {exc}"


def task_prompt():
    task_file = ROOT / "TASK.md"
    if task_file.is_file():
        return task_file.read_text()
    if len(sys.argv) > 1:
        return sys.argv[1]
    sys.exit("usage: agent.py TASK (or put the task in TASK.md)")


def main():
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task_prompt()}]
    client = openai.OpenAI(max_retries=int(os.environ.get("AGENT_MAX_RETRIES", "2")))
    model = os.environ.get("OPENAI_MODEL", "gyreflow-policy")
    nudged = False
    for turn in range(int(os.environ.get("AGENT_MAX_TURNS", "12"))):
        try:
            reply = client.chat.completions.create(
                model=model,
                messages=messages,
                tools=TOOLS,
                tool_choice="auto",
                max_tokens=int(os.environ.get("AGENT_MAX_TOKENS", "256")),
                temperature=float(os.environ.get("AGENT_TEMPERATURE", "1.0")),
            )
        except openai.APIError as exc:  # e.g. the server's budget for this run is spent
            print(f"server error: {exc}", file=sys.stderr)
            return 1
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            print(f"[{turn}] no tool call: {(message.content or '')[:200]!r}")
            if nudged:
                return 0
            nudged = True
            messages.append({"role": "user", "content": NUDGE})
            continue
        nudged = False
        finished = False
        for call in message.tool_calls:
            function = getattr(call, "function", None)  # None for a non-function (custom) tool call
            name, arguments = (function.name, function.arguments) if function else (None, None)
            result = call_tool(name, arguments)
            print(f"[{turn}] {name}({str(arguments)[:200]}) -> {result[:200]!r}")
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            finished = finished or name == "finish"
        if finished:
            return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
