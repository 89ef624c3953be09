"""Configuration of the decoder LM: dense (Llama / Qwen2 / Qwen3) or mixture-of-experts
(Qwen2-MoE / Qwen3-MoE, DeepSeek-V3-style routing options)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from veomni.ops.rope import check_rope_scaling

FAMILIES = ("llama", "qwen2", "qwen3")
ROUTER_SCORING = ("softmax", "sigmoid")


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
    mrope_section: tuple[int, ...] | None = None
    """Multimodal RoPE (Qwen2-VL / Qwen2.5-VL): sizes of the blocks of frequency slots that turn with
    the t, h, w positions in turn (summing to head_dim // 2); position_ids are then [T, 3]. None: 1-D."""
    init_std: float = 0.02
    family: str = "qwen3"
    # ----- mixture of experts (num_experts = 0: every layer has the dense MLP) -----
    num_experts: int = 0
    """Routed experts per MoE layer; > 0 turns every layer's MLP into an MoE block."""
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    shared_expert_intermediate_size: int = 0
    """Width of one shared SwiGLU expert every token goes through (0: none; Qwen2-MoE has one)."""
    shared_expert_gate: bool = False
    """Scale the shared expert by sigmoid(linear(x)) as Qwen2-MoE does."""
    router_scoring: str = "softmax"
    """softmax (Qwen-MoE, Mixtral) or sigmoid (DeepSeek-V3) expert scores."""
    norm_topk_prob: bool = True
    """Renormalise the k selected scores to sum to 1."""
    routed_scaling_factor: float = 1.0
    router_aux_loss_coef: float = 0.0
    """Switch/GShard load-balancing loss weight, per MoE layer (0: off)."""
    router_z_loss_coef: float = 0.0
    """ST-MoE router z-loss weight, per MoE layer (0: off)."""
    router_bias_update_rate: float = 0.0
    """Auxiliary-loss-free balancing (DeepSeek-V3): per-expert selection bias moved by this much
    per step towards the mean load (0: off)."""
    capacity_factor: float = 0.0
    """Per-expert capacity ``ceil(cf * tokens * k / E)``; assignments beyond it are dropped.
    0 (default): no token is ever dropped."""

    def __post_init__(self) -> None:
        if self.mrope_section is not None:
            self.mrope_section = tuple(self.mrope_section)  # a YAML list compares as a tuple

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
        if self.mrope_section is not None and (
            len(self.mrope_section) != 3 or sum(self.mrope_section) != self.dim_per_head // 2
            or min(self.mrope_section) < 0
        ):
            raise ValueError(f"mrope_section must be three sizes (t, h, w) >= 0 summing to head_dim // 2 = "
                             f"{self.dim_per_head // 2}, got {self.mrope_section!r}")
        self._validate_family()
        if self.num_experts:
            self._validate_moe()

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def block_matmul_params(self) -> int:
        """Weights of one block that take part in a matmul per token: attention projections and
        the FFN; for an MoE FFN only the activated ones (router, the k selected experts, shared
        expert and its gate: the E - k other experts do no work for this token)."""
        q_dim, kv_dim = self.num_heads * self.dim_per_head, self.num_kv_heads * self.dim_per_head
        attn = self.hidden_size * (2 * q_dim + 2 * kv_dim)
        if not self.is_moe:
            return attn + 3 * self.hidden_size * self.intermediate_size
        return attn + self.hidden_size * (self.num_experts + 3 * self.num_experts_per_tok * self.moe_intermediate_size
                                          + 3 * self.shared_expert_intermediate_size + int(self.shared_expert_gate))

    def _validate_moe(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts ({self.num_experts})"
            )
        if self.moe_intermediate_size <= 0 or self.shared_expert_intermediate_size < 0:
            raise ValueError("moe_intermediate_size must be > 0 and shared_expert_intermediate_size >= 0")
        if self.shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError("shared_expert_gate needs a shared expert: set shared_expert_intermediate_size")
        if self.router_scoring not in ROUTER_SCORING:
            raise ValueError(f"router_scoring must be one of {ROUTER_SCORING}, got {self.router_scoring!r}")
        for name in ("router_aux_loss_coef", "router_z_loss_coef", "router_bias_update_rate", "capacity_factor"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

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
