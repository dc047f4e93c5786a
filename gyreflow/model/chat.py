"""The chat format in token space.

Native agents build prompts by appending token ids, so the ids the engine sampled are reused
verbatim in later prompts and are never re-encoded from text.
"""

from __future__ import annotations

import numpy as np

from gyreflow.model.tokenizer import SPECIAL_TOKENS

SPECIAL_ID = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
PAD_ID = SPECIAL_ID["<|pad|>"]
END_ID = SPECIAL_ID["<|end|>"]
ROLE_ID = {
    "system": SPECIAL_ID["<|system|>"],
    "user": SPECIAL_ID["<|user|>"],
    "assistant": SPECIAL_ID["<|assistant|>"],
    "tool": SPECIAL_ID["<|tool|>"],
}


def encode_text(text: str) -> list[int]:
    """Plain text to ids: the UTF-8 bytes (special-token strings are not interpreted)."""
    return list(text.encode("utf-8"))


def decode_ids(ids) -> str:
    """Ids to text; special tokens are dropped, invalid UTF-8 is replaced."""
    return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


def message_ids(role: str, text: str) -> list[int]:
    """One whole message: ``<|role|>text<|end|>``."""
    return [ROLE_ID[role], *encode_text(text), END_ID]


def generation_prompt_ids() -> list[int]:
    """The header after which the assistant's completion is sampled."""
    return [ROLE_ID["assistant"]]


def as_ids(ids) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)
