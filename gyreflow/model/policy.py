"""The policy: a Llama-architecture causal LM from Hugging Face transformers, built from a config.

Checkpoints are plain Hugging Face directories (``config.json`` + ``model.safetensors`` +
tokenizer files), so ``transformers.AutoModelForCausalLM.from_pretrained`` and vLLM load them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM

from gyreflow.model.config import ModelConfig
from gyreflow.model.tokenizer import build_tokenizer


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
