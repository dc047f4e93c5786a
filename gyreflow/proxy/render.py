"""Messages to prompt ids, with the model's own chat template.

An agent sends its history back as text, often re-formatted: arguments re-serialized, content
``null`` where the model wrote ``""``, a stop string dropped. Rendering that text again would train
the model on turns it never produced. So each assistant turn the proxy served is cached by its
tool-call ids (or its exact text), and when the turn comes back the renderer splices in the ids
the engine really sampled. Everything else is rendered from the messages as given: a call's
prompt is never assumed to extend the previous one.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

import numpy as np

class ChatRenderer:
    """Render chat messages with a Hugging Face tokenizer's chat template.

    Parameters
    ----------
    tokenizer
        A ``transformers`` tokenizer with a ``chat_template``.
    """

    def __init__(self, tokenizer, cache_tokens: int = 1 << 22) -> None:
        self.tokenizer = tokenizer
        self.eos_id = int(tokenizer.eos_token_id)
        self.eos_text = tokenizer.eos_token
        self.cache_tokens = cache_tokens
        self._cache: OrderedDict[str, list[int]] = OrderedDict()
        self._cached = 0
        self.piecewise = self._splits_at_end_of_turn()
        """Whether text may be encoded one turn at a time (then each turn's ids are cached, and a
        call encodes only the turns it adds: agents resend their whole history every call)."""

    def _encode_whole(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def _splits_at_end_of_turn(self) -> bool:
        # A tokenizer that merges across the end-of-turn token, or marks the start of a text,
        # encodes a turn differently alone: then only whole texts are encoded.
        e = self.eos_text
        return all(self._encode_whole(a + e + b) == self._encode_whole(a + e) + self._encode_whole(b)
                   for a, b in (("a", "b"), ("a", " b"), ("x\n", "\ny"), ("1", "2")))

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (special-token strings become their ids)."""
        if not self.piecewise or len(text) < 64:
            return self._encode_whole(text)
        ids: list[int] = []
        pieces = text.split(self.eos_text)
        for i, piece in enumerate(pieces):
            ids += self._piece(piece + self.eos_text if i < len(pieces) - 1 else piece)
        return ids

    def _piece(self, piece: str) -> list[int]:
        hit = self._cache.get(piece)
        if hit is not None:
            self._cache.move_to_end(piece)
            return hit
        ids = self._encode_whole(piece)
        if len(ids) <= self.cache_tokens // 4:
            self._cache[piece] = ids
            self._cached += len(ids)
            while self._cached > self.cache_tokens:
                self._cached -= len(self._cache.popitem(last=False)[1])
        return ids

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token, also when it holds part of a character (byte-level BPE
        vocabularies spell bytes with printable aliases; other tokens are decoded)."""
        from gyreflow.model.tokenizer import byte_aliases

        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if piece in self.tokenizer.all_special_tokens:
            return piece.encode("utf-8")
        table = byte_aliases()
        if piece and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return self.tokenizer.decode([int(token_id)]).encode("utf-8")

    def render(self, messages: list[dict], tools: list[dict], restored: dict[int, np.ndarray],
               forced_prefix: str = "") -> np.ndarray:
        """Prompt ids for ``messages`` followed by the generation prompt and ``forced_prefix``.

        ``restored`` maps the index of an assistant message to the exact ids of that turn (what the
        engine sampled, ending in the end-of-turn token when it stopped there).
        """
        # A placeholder no message holds (drawn anew until so) marks where each restored turn goes.
        mark = "\x00gyreflow-" + secrets.token_hex(8)
        while any(mark in m["content"] for m in messages):
            mark = "\x00gyreflow-" + secrets.token_hex(8)
        shown = [({"role": "assistant", "content": f"{mark}:{i}:"} if i in restored else m)
                 for i, m in enumerate(messages)]
        text = self.tokenizer.apply_chat_template(shown, tools=tools or None, add_generation_prompt=True,
                                                  tokenize=False)
        ids: list[int] = []
        rest = text
        while mark in rest:
            before, _, after = rest.partition(mark + ":")
            index, _, rest = after.partition(":")
            ids += self.encode(before)
            turn = [int(t) for t in restored[int(index)]]
            ids += turn
            # The sampled turn already ends with the end-of-turn token the template writes next.
            if turn and turn[-1] == self.eos_id and rest.startswith(self.eos_text):
                rest = rest[len(self.eos_text):]
        ids += self.encode(rest + forced_prefix)
        return np.asarray(ids, dtype=np.int32)
