"""A byte-level tokenizer with a chat template, built offline.

Token ids 0..255 are the UTF-8 bytes themselves, so any text round-trips exactly and
``ids -> bytes`` needs no lookup table. Special tokens follow from id 256.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loaded where a tokenizer is made: the chat format's ids need no transformers
    from transformers import PreTrainedTokenizerFast

PAD, END, SYSTEM, USER, ASSISTANT, TOOL = (
    "<|pad|>",
    "<|end|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
)
SPECIAL_TOKENS = [PAD, END, SYSTEM, USER, ASSISTANT, TOOL]
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# Each message is `<|role|>content<|end|>`; the generation prompt is `<|assistant|>`.
# Tool results are `<|tool|>` messages. With tools, a system message lists each tool's JSON
# function spec (the first system message, if any, comes first in it); an assistant's tool calls
# follow its content as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (plain bytes: the
# byte vocabulary has no spare special ids). The proxy renders with this template and parses
# completions with the matching "hermes" tool-call parser.
CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is none -%}{%- elif content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- set skip_first = tools and messages and messages[0]['role'] == 'system' -%}"
    "{%- if tools -%}"
    "{{ '<|system|>' }}{%- if skip_first -%}{{ text(messages[0]['content']) }}{{ '\n' }}{%- endif -%}"
    "{{ 'tools:' }}{%- for tool in tools -%}{{ '\n' }}{{ (tool['function'] if 'function' in tool else tool) | tojson }}{%- endfor -%}"
    "{{ '\ncall a tool: <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>' }}{{ '<|end|>' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if not (skip_first and loop.first) -%}"
    "{{ '<|' + message['role'] + '|>' }}{{ text(message['content']) }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{%- set fn = call['function'] -%}"
    "{{ '<tool_call>{\"name\": ' }}{{ fn['name'] | tojson }}{{ ', \"arguments\": ' }}"
    "{%- if fn['arguments'] is string -%}{{ fn['arguments'] }}{%- else -%}{{ fn['arguments'] | tojson }}{%- endif -%}"
    "{{ '}</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|end|>' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)


@cache
def _bytes_to_unicode() -> dict[int, str]:
    # The ByteLevel pre-tokenizer's printable alias of every byte (GPT-2's table).
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@cache
def byte_aliases() -> dict[str, int]:
    """Alias character -> byte, as byte-level BPE vocabularies (GPT-2's table) spell bytes."""
    return {c: b for b, c in _bytes_to_unicode().items()}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the byte-level tokenizer (no hub access).

    Returns
    -------
    PreTrainedTokenizerFast
        ids 0..255 are bytes, 256.. are :data:`SPECIAL_TOKENS`; ``eos_token`` is ``<|end|>``.
    """
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    alias = _bytes_to_unicode()
    vocab = {alias[b]: b for b in range(256)}
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + i
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        eos_token=END,
        model_max_length=1 << 20,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved next to a checkpoint (``save_pretrained`` format)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(path))
