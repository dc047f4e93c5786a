"""Policy model and tokenizer: a Hugging Face causal LM and a byte-level tokenizer, made offline."""

from gyreflow.model.tokenizer import SPECIAL_TOKENS, build_tokenizer, load_tokenizer
from gyreflow.model.policy import ModelConfig, build_policy, load_policy, save_policy, state_dict_numpy

__all__ = [
    "SPECIAL_TOKENS",
    "ModelConfig",
    "build_tokenizer",
    "load_tokenizer",
    "build_policy",
    "load_policy",
    "save_policy",
    "state_dict_numpy",
]
