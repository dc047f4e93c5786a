"""The policy: a Llama-architecture causal LM from Hugging Face transformers, built from a config.

Checkpoints are plain Hugging Face directories (``config.json`` + ``model.safetensors`` +
tokenizer files), so ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gyreflow.model.tokenizer import VOCAB_SIZE, build_tokenizer


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the policy network."""

    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 384
    """Width of each SwiGLU MLP."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads (query)."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    max_position_embeddings: int = 4096
    """Longest context the rotary embedding is configured for."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    rope_type: str = "default"
    """Rope scaling as Hugging Face names it (``default``, ``linear``, ``llama3``, ``yarn``): how
    positions beyond ``rope_original_positions`` are reached."""
    rope_factor: float = 1.0
    """Context extension factor of a scaled rope type."""
    rope_original_positions: int | None = None
    """Positions the rotary embedding was designed for before scaling (scaled types only)."""

    def hf_config(self) -> LlamaConfig:
        scaling = None
        if self.rope_type != "default":
            scaling = {"rope_type": self.rope_type, "factor": float(self.rope_factor), "rope_theta": self.rope_theta,
                       "original_max_position_embeddings": int(self.rope_original_positions or self.max_position_embeddings)}
            if self.rope_type == "llama3":
                scaling.update(low_freq_factor=1.0, high_freq_factor=4.0)
        return LlamaConfig(
            rope_scaling=scaling,
            vocab_size=VOCAB_SIZE,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            tie_word_embeddings=True,
            pad_token_id=256,
            eos_token_id=257,
            bos_token_id=None,
        )

    def asdict(self) -> dict:
        return asdict(self)


def build_policy(cfg: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """A randomly initialised policy (float32, eval mode)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg.hf_config())
    model.eval()
    return model


def save_policy(model: LlamaForCausalLM, path: str | Path, tokenizer=None) -> Path:
    """Write ``model`` (and its tokenizer) as a Hugging Face checkpoint directory."""
    from transformers.utils import logging as hf_logging

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()  # a one-shard "Writing model shards" bar is noise in run logs
    model.save_pretrained(str(path), safe_serialization=True)
    (tokenizer or build_tokenizer()).save_pretrained(str(path))
    return path


def load_policy(path: str | Path) -> LlamaForCausalLM:
    """Load a checkpoint directory written by :func:`save_policy` (or any HF Llama checkpoint)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: config.json is missing")
    model = LlamaForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    model.eval()
    return model


def state_dict_numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Weights as plain numpy arrays: what is published to engines (no pickled torch objects)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


def load_state_dict_numpy(model: torch.nn.Module, weights: dict[str, np.ndarray]) -> None:
    """Copy published weights into ``model`` in place."""
    own = model.state_dict()
    missing = set(own) - set(weights)
    if missing:
        raise KeyError(f"published weights lack {sorted(missing)[:3]}")
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(torch.from_numpy(np.asarray(weights[k])))


LONG_CONTEXT = ModelConfig(
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    max_position_embeddings=131072,
    rope_type="yarn",  # 4,096 designed positions stretched x32, as long-context checkpoints ship
    rope_factor=32.0,
    rope_original_positions=4096,
)
"""A policy shape with 128K positions, small enough that a 128K-token prefill takes seconds on one
CPU core (engine tests and ``gyreflow bench engine``)."""
