"""The model's tool-call syntax: parsing completions into tool calls, and the prompt prefix that
forces a call when ``tool_choice`` demands one.

A parser belongs with a chat template (the template renders calls, the parser reads them back);
:data:`TOOL_PARSERS` is the one place a parser is chosen by name.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str
    """The arguments as a JSON text."""


class ToolCallParser(Protocol):
    def parse(self, text: str, tool_names: set[str]) -> tuple[str, list[ParsedCall]]:
        """Split a completion's text into its plain content and its tool calls."""
        ...

    def forced_prefix(self, tool_choice: str | tuple[str, str]) -> str:
        """Text appended to the generation prompt so that the model must call a tool ('' for none)."""
        ...

    def constraint(self, tool_choice: str | tuple[str, str], tool_names: list[str], end_id: int) -> str | None:
        """The template (:mod:`gyreflow.engine.constraints`) that makes the completion after
        :meth:`forced_prefix` one valid call of an allowed tool; ``None`` when no call is forced."""
        ...


class HermesParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks after the content.

    A block that is not valid JSON, lacks a name, or names a tool the request did not declare
    stays in the content as text: the agent sees what the model wrote.
    """

    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def parse(self, text: str, tool_names: set[str]) -> tuple[str, list[ParsedCall]]:
        calls: list[ParsedCall] = []
        kept: list[str] = []
        pos = 0
        for m in self.BLOCK.finditer(text):
            call = self._call(m.group(1), tool_names)
            if call is None:
                continue
            kept.append(text[pos:m.start()])
            pos = m.end()
            calls.append(call)
        kept.append(text[pos:])
        return "".join(kept).strip() if calls else text, calls

    @staticmethod
    def _call(raw: str, tool_names: set[str]) -> ParsedCall | None:
        try:
            obj = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in tool_names:
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))

    def constraint(self, tool_choice: str | tuple[str, str], tool_names: list[str], end_id: int) -> str | None:
        tail = [{"json_object": True}, {"literal": "}</tool_call>"}, {"end": end_id}]
        if tool_choice == "required":
            return json.dumps([{"choice": [json.dumps(n)[1:] + ', "arguments": ' for n in tool_names]}] + tail)
        if isinstance(tool_choice, tuple):
            return json.dumps(tail)
        return None

    def forced_prefix(self, tool_choice: str | tuple[str, str]) -> str:
        if tool_choice == "required":
            return '<tool_call>{"name": "'
        if isinstance(tool_choice, tuple):
            return '<tool_call>{"name": ' + json.dumps(tool_choice[1]) + ', "arguments": '
        return ""


TOOL_PARSERS: dict[str, ToolCallParser] = {"hermes": HermesParser()}
