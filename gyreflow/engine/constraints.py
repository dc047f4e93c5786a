"""Constrained decoding over a byte vocabulary: a completion that must follow a template.

A template is a list of parts, matched in order by the completion's bytes:

``{"choice": [s1, s2, ...]}``
    exactly one of the strings;
``{"json_object": true}``
    one JSON object (strings of printable ASCII);
``{"literal": s}``
    the string itself;
``{"end": token_id}``
    the end-of-turn token, after which nothing follows.

The engine masks every token that cannot continue the template, and also every token after
which the template could no longer be finished within ``max_tokens``, so a constrained
completion always parses. The proxy uses it for ``tool_choice`` "required" or a named function.
Token ids below 256 are bytes (see :mod:`gyreflow.model.tokenizer`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

END = object()
"""The end-of-turn token, as an input to :meth:`Template.advance`."""

_DIGITS = frozenset(b"0123456789")
_PRINTABLE = frozenset(range(0x20, 0x7F)) - {ord('"'), ord("\\")}
_ESCAPES = frozenset(b'"\\/bfnrt')
_HEX = frozenset(b"0123456789abcdefABCDEF")
_SPACE = frozenset(b" \n\t\r")
_BETWEEN = frozenset({"key_or_close", "key", "colon", "value", "value_or_close", "after_value"})
"""Modes where whitespace may come before the next token."""


@dataclass(frozen=True)
class _Json:
    """Where a JSON object's parse stands: the open containers and what may come next."""

    stack: tuple[str, ...]  # "{" or "[" per open container
    mode: str
    """start, key_or_close, key, colon, value, value_or_close, after_value, string, key_string,
    escape, unicode, number, literal, done."""
    detail: tuple = ()
    """number: its state; literal: bytes still due; unicode: hex digits due; escape: the string kind."""

    def step(self, b: int) -> "_Json | None":
        m, st, d = self.mode, self.stack, self.detail
        if m in _BETWEEN and b in _SPACE:
            return self
        if m == "start":
            return _Json(("{",), "key_or_close") if b == ord("{") else None
        if m in ("key_or_close", "key"):
            if b == ord('"'):
                return _Json(st, "key_string")
            if m == "key_or_close" and b == ord("}"):
                return self._closed(st[:-1])
            return None
        if m == "colon":
            return _Json(st, "value") if b == ord(":") else None
        if m in ("value", "value_or_close"):
            if m == "value_or_close" and b == ord("]"):
                return self._closed(st[:-1])
            return self._value_start(b)
        if m == "after_value":
            if b == ord(","):
                return _Json(st, "key" if st[-1] == "{" else "value")
            if b == ord("}" if st[-1] == "{" else "]"):
                return self._closed(st[:-1])
            return None
        if m in ("string", "key_string"):
            if b == ord('"'):
                return _Json(st, "colon") if m == "key_string" else self._closed(st)
            if b == ord("\\"):
                return _Json(st, "escape", (m,))
            return self if b in _PRINTABLE else None
        if m == "escape":
            if b == ord("u"):
                return _Json(st, "unicode", (d[0], 4))
            return _Json(st, d[0]) if b in _ESCAPES else None
        if m == "unicode":
            if b not in _HEX:
                return None
            return _Json(st, d[0]) if d[1] == 1 else _Json(st, "unicode", (d[0], d[1] - 1))
        if m == "literal":
            if b != d[0]:
                return None
            return self._closed(st) if len(d) == 1 else _Json(st, "literal", d[1:])
        if m == "number":
            nxt = _number_step(d[0], b)
            if nxt is not None:
                return _Json(st, "number", (nxt,))
            if d[0] in _NUMBER_ENDS:  # the number is complete: b continues the container
                return self._closed(st).step(b)
            return None
        return None  # done

    def _value_start(self, b: int) -> "_Json | None":
        st = self.stack
        if b == ord('"'):
            return _Json(st, "string")
        if b == ord("{"):
            return _Json(st + ("{",), "key_or_close")
        if b == ord("["):
            return _Json(st + ("[",), "value_or_close")
        if b == ord("-"):
            return _Json(st, "number", ("sign",))
        if b == ord("0"):
            return _Json(st, "number", ("zero",))
        if b in _DIGITS:
            return _Json(st, "number", ("int",))
        for word in (b"true", b"false", b"null"):
            if b == word[0]:
                return _Json(st, "literal", tuple(word[1:]))
        return None

    @staticmethod
    def _closed(stack: tuple[str, ...]) -> "_Json":
        """A value just ended inside ``stack`` (the object itself ended when the stack is empty)."""
        return _Json(stack, "after_value") if stack else _Json((), "done")

    def shortest_rest(self) -> int:
        """Fewest bytes that complete the object from here."""
        m, st, d = self.mode, self.stack, self.detail
        closers = len(st)
        if m == "done":
            return 0
        if m == "start":
            return 2  # {}
        if m in ("key_or_close", "value_or_close", "after_value"):
            return closers
        if m == "key":
            return 4 + closers  # "":0 then the closers
        if m == "colon":
            return 2 + closers  # :0
        if m == "value":
            return 1 + closers
        if m in ("string", "key_string"):
            return 1 + (2 if m == "key_string" else 0) + closers
        if m == "escape":
            return 2 + (2 if d[0] == "key_string" else 0) + closers
        if m == "unicode":
            return d[1] + 1 + (2 if d[0] == "key_string" else 0) + closers
        if m == "literal":
            return len(d) + closers
        if m == "number":
            return (0 if d[0] in _NUMBER_ENDS else 1) + closers
        raise AssertionError(m)


_NUMBER_ENDS = frozenset({"zero", "int", "frac", "exp"})


def _number_step(state: str, b: int) -> str | None:
    digit = b in _DIGITS
    if state == "sign":
        return "zero" if b == ord("0") else ("int" if digit else None)
    if state in ("zero", "int"):
        if state == "int" and digit:
            return "int"
        if b == ord("."):
            return "dot"
        return "e" if b in (ord("e"), ord("E")) else None
    if state in ("dot", "frac"):
        if digit:
            return "frac"
        return "e" if state == "frac" and b in (ord("e"), ord("E")) else None
    if state == "e":
        return "esign" if b in (ord("+"), ord("-")) else ("exp" if digit else None)
    if state in ("esign", "exp"):
        return "exp" if digit else None
    return None


@dataclass(frozen=True)
class _State:
    part: int
    """Index of the part being matched (``len(parts)`` once the end token is in)."""
    text: bytes = b""
    """Bytes matched of a choice or literal part."""
    json: _Json | None = None


class Template:
    """A template (see the module docstring), compiled; states are immutable values."""

    def __init__(self, parts: list[dict]) -> None:
        if not parts or not isinstance(parts, list):
            raise ValueError("a constraint template needs a non-empty list of parts")
        self.parts: list[tuple[str, object]] = []
        self.end_id: int | None = None
        for p in parts:
            if not isinstance(p, dict) or len(p) != 1:
                raise ValueError(f"constraint part {p!r} must be one of choice, json_object, literal, end")
            kind, value = next(iter(p.items()))
            if kind == "choice":
                options = tuple(s.encode() for s in value)
                if not options or any(not o for o in options):
                    raise ValueError("a choice part needs non-empty strings")
                self.parts.append(("choice", options))
            elif kind == "literal":
                self.parts.append(("literal", str(value).encode()))
            elif kind == "json_object":
                self.parts.append((kind, None))
            elif kind == "end":
                if not isinstance(value, int) or isinstance(value, bool) or value < 256:
                    raise ValueError(f"the end part names a special token id (>= 256), got {value!r}")
                self.end_id = value
                self.parts.append((kind, value))
            else:
                raise ValueError(f"unknown constraint part {kind!r}")

    @classmethod
    def from_spec(cls, spec: str) -> "Template":
        """A template from its JSON text (what :class:`~gyreflow.engine.base.SamplingParams` carries)."""
        try:
            parts = json.loads(spec)
        except ValueError as err:
            raise ValueError(f"constraint is not JSON: {err}") from None
        return cls(parts)

    def start(self) -> _State:
        return self._enter(0)

    def _enter(self, i: int) -> _State:
        if i < len(self.parts) and self.parts[i][0] == "json_object":
            return _State(i, json=_Json((), "start"))
        return _State(i)

    def advance(self, s: _State, token) -> _State | None:
        """The state after ``token`` (a byte, or :data:`END`); ``None`` when it breaks the template."""
        if s.part >= len(self.parts):
            return None
        kind, value = self.parts[s.part]
        if kind == "end":
            return _State(s.part + 1) if token is END else None
        if token is END:
            return None
        if kind == "json_object":
            nxt = s.json.step(token)
            if nxt is None:
                return None
            return self._enter(s.part + 1) if nxt.mode == "done" else _State(s.part, json=nxt)
        text = s.text + bytes([token])
        options = value if kind == "choice" else (value,)
        if not any(o.startswith(text) for o in options):
            return None
        return self._enter(s.part + 1) if text in options else _State(s.part, text)

    def shortest_rest(self, s: _State) -> int:
        """Fewest tokens (the end token included) that finish the template from ``s``."""
        n = 0
        for i in range(s.part, len(self.parts)):
            kind, value = self.parts[i]
            if kind == "end":
                n += 1
            elif kind == "json_object":
                n += (s.json if i == s.part else _Json((), "start")).shortest_rest()
            else:
                options = value if kind == "choice" else (value,)
                done = len(s.text) if i == s.part else 0
                n += min(len(o) for o in options if o.startswith(s.text if i == s.part else b"")) - done
        return n

    def allowed(self, s: _State, budget: int, vocab: int) -> np.ndarray:
        """(V,) bool: the tokens that continue the template and leave it finishable within
        ``budget`` tokens (this one included)."""
        ok = np.zeros(vocab, dtype=bool)
        for b in range(256):
            nxt = self.advance(s, b)
            if nxt is not None and self.shortest_rest(nxt) <= budget - 1:
                ok[b] = True
        if self.end_id is not None and self.end_id < vocab and self.advance(s, END) is not None:
            ok[self.end_id] = True
        return ok

    def token(self, token_id: int):
        """A sampled token id as an input to :meth:`advance`."""
        return END if token_id == self.end_id else int(token_id)

    def replay(self, tokens) -> _State:
        """The state after a sequence of tokens (an imported request's completion)."""
        s = self.start()
        for t in tokens:
            s = self.advance(s, self.token(int(t)))
            if s is None:
                raise ValueError("the completion so far does not follow its constraint")
        return s
