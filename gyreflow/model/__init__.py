"""Policy model and tokenizer: a Hugging Face causal LM and a byte-level tokenizer, made offline.

The names below load on first use (PEP 562): the chat format (:mod:`gyreflow.model.chat`) is
imported by processes that never build a model, and torch and transformers take seconds to import.
"""

from importlib import import_module

_EXPORTS = {
    "SPECIAL_TOKENS": "gyreflow.model.tokenizer",
    "build_tokenizer": "gyreflow.model.tokenizer",
    "load_tokenizer": "gyreflow.model.tokenizer",
    "ModelConfig": "gyreflow.model.config",
    "build_policy": "gyreflow.model.policy",
    "load_policy": "gyreflow.model.policy",
    "save_policy": "gyreflow.model.policy",
    "state_dict_numpy": "gyreflow.model.policy",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'gyreflow.model' has no attribute {name!r}")
