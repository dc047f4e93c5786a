"""The policy network's shape: read by the run configuration, which loads neither torch nor
transformers (:mod:`gyreflow.model.policy` builds the network)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from gyreflow.model.tokenizer import VOCAB_SIZE

if TYPE_CHECKING:
    from transformers import LlamaConfig


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
        from transformers import LlamaConfig

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
