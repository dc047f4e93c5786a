"""Real models and engines behind the proxy, for the proxy's tests.

``tool_model`` is the tiny policy trained in a few seconds to answer given prompts with given
texts (a tool call, then a final answer), so that tool-call paths are exercised by what a real
engine samples rather than by canned responses.
"""

from __future__ import annotations

import asyncio

import torch

from gyreflow.engine.torch_engine import TorchEngine
from gyreflow.engine.runner import EngineRunner
from gyreflow.model import ModelConfig, build_policy, build_tokenizer
from gyreflow.model.chat import END_ID
from gyreflow.proxy.local import EngineBackend

TOOLS = [
    {"type": "function", "function": {"name": "go", "description": "open a door",
                                      "parameters": {"type": "object", "properties": {"door": {"type": "string"}},
                                                     "required": ["door"]}}},
    {"type": "function", "function": {"name": "read", "description": "read the note",
                                      "parameters": {"type": "object", "properties": {}}}},
]
SMALL = ModelConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=2)
TASK = "open door a"
CALL_TEXT = '<tool_call>{"name": "go", "arguments": {"door": "a"}}</tool_call>'
FINAL_TEXT = "the door is open"


def conversations() -> list[tuple[list[dict], list[dict] | None, str]]:
    """(messages, tools, the assistant text to learn): a tool call, then an answer after its result."""
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "x", "type": "function", "function": {"name": "go", "arguments": '{"door": "a"}'}}]}
    first = [{"role": "user", "content": TASK}]
    return [
        (first, TOOLS, CALL_TEXT),
        (first + [call, {"role": "tool", "tool_call_id": "x", "content": "opened"}], TOOLS, FINAL_TEXT),
    ]


def train_tool_model(seed: int = 0, steps: int = 400):
    """The tiny policy, fitted to :func:`conversations` until greedy decoding reproduces them."""
    tok = build_tokenizer()
    torch.manual_seed(seed)
    model = build_policy(SMALL, seed=seed)
    rows = []
    for messages, tools, target in conversations():
        prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        p = tok.encode(prompt, add_special_tokens=False)
        t = tok.encode(target, add_special_tokens=False) + [END_ID]
        rows.append((torch.tensor(p + t), len(p)))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss, greedy = 0.0, True
        for ids, n in rows:
            logits = model(ids[None, :-1]).logits[0]  # (T-1, V)
            loss = loss + torch.nn.functional.cross_entropy(logits[n - 1:], ids[n:])
            greedy &= bool((logits[n - 1:].argmax(-1) == ids[n:]).all())
        opt.zero_grad()
        loss.backward()
        opt.step()
        # Every target token the most likely one, with a margin (mean probability above 0.99).
        if greedy and loss.item() < 0.02:
            break
    model.eval()
    return model


class Journal:
    """An engine's own record of what it served: every request and result, in order."""

    def __init__(self, engine, delay_s: float = 0.0) -> None:
        self.backend = EngineBackend(engine)
        self.delay_s = delay_s
        self.served: list = []

    async def __call__(self, request):
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        result = await self.backend(request)
        self.served.append((request, result))
        return result


def start_engine(model, **kwargs) -> EngineRunner:
    return EngineRunner(TorchEngine(model, max_batch=8, **kwargs)).start()
