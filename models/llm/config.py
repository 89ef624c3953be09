"""Configuration of the dense decoder LM (Llama / Qwen2 / Qwen3 families)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from veomni.ops.rope import check_rope_scaling

FAMILIES = ("llama", "qwen2", "qwen3")


@dataclass
class LLMConfig:
    """Architecture hyper-parameters. Defaults are Qwen3-0.6B.

    ``family`` names the HF architecture the model exports to; ``validate()`` checks that the
    bias / norm options are ones that family can express (Llama and Qwen3 tie q/k/v biases to an
    o_proj bias we do not have, Qwen2 always has q/k/v biases, only Qwen3 has q/k norms).
    """

    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int | None = 128
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    qkv_bias: bool = False
    qk_norm: bool = True
    max_position_embeddings: int = 40960
    init_std: float = 0.02
    family: str = "qwen3"

    @property
    def dim_per_head(self) -> int:
        """``head_dim``, or ``hidden_size // num_heads`` when it is None."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field(s) of the first impossible combination."""
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads}) "
                "when head_dim is not set"
            )
        if self.dim_per_head <= 0 or self.dim_per_head % 2:
            raise ValueError(
                f"head_dim must be a positive even int (RoPE rotates pairs), got {self.dim_per_head}"
            )
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0 or self.init_std <= 0:
            raise ValueError("rope_theta, rms_norm_eps and init_std must be > 0")
        check_rope_scaling(self.rope_scaling)
        self._validate_family()

    def _validate_family(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.family == "qwen2" and not self.qkv_bias:
            raise ValueError("family 'qwen2' always has q/k/v biases: set qkv_bias=True")
        if self.family in ("llama", "qwen3") and self.qkv_bias:
            raise ValueError(
                f"family {self.family!r} cannot export qkv_bias without an o_proj bias; use family 'qwen2'"
            )
        if self.qk_norm != (self.family == "qwen3"):
            raise ValueError(
                f"qk_norm={self.qk_norm} does not fit family {self.family!r}: only 'qwen3' has q/k norms"
            )
