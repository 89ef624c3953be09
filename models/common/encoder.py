"""Pre-norm bidirectional transformer block shared by the modality encoders (ViT, audio).

Attention runs within each packed sample (an image, a video frame, an audio clip) through
the ``attn_fn`` injection point; the caller supplies the rotary ``cos/sin`` (2D for images,
1D for audio), so the block itself is position-agnostic. Parameter names (``norm1``,
``attn.qkv``, ``attn.proj``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``) follow HF's Qwen2-VL vision
blocks so weights map one to one. Qwen2.5-VL's blocks are the same block with two options:
RMSNorm for LayerNorm and a gated MLP (``mlp.gate_proj``, ``mlp.up_proj``, ``mlp.down_proj``, its
names too), so one block class serves both towers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from veomni.contract.hooks import AttentionSpec
from veomni.ops.attention import RowShare, SeqInfo, bidirectional_varlen_attention
from veomni.ops.norm import RMSNorm
from veomni.ops.rope import apply_rope

HIDDEN_ACTS = ("gelu", "quick_gelu", "silu")


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"gelu": F.gelu, "quick_gelu": _quick_gelu, "silu": F.silu}


class EncoderAttention(nn.Module):
    """Multi-head self-attention with a fused qkv projection and RoPE on q and k."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = self.num_kv_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj = nn.Linear(hidden_size, hidden_size)
        self.attn_fn = bidirectional_varlen_attention

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim, causal=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = apply_rope(q, k, cos, sin)
        out = self.attn_fn(q, k, v, seq)
        return self.proj(out.reshape(tokens, self.num_heads * self.head_dim))


class EncoderMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {hidden_act!r}")
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)
        self.act = _ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedEncoderMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with biases (Qwen2.5-VL's vision MLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {hidden_act!r}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size)
        self.up_proj = nn.Linear(hidden_size, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, hidden_size)
        self.act = _ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def encoder_norm(kind: str, hidden_size: int, eps: float) -> nn.Module:
    """``"layernorm"`` (with bias) or ``"rmsnorm"`` (HF numerics, ``veomni.ops.norm``)."""
    if kind == "layernorm":
        return nn.LayerNorm(hidden_size, eps=eps)
    if kind == "rmsnorm":
        return RMSNorm(hidden_size, eps)
    raise ValueError(f"norm must be 'layernorm' or 'rmsnorm', got {kind!r}")


class EncoderBlock(nn.Module):
    """Pre-norm residual block: attention then MLP; ``norm`` LayerNorm or RMSNorm, ``mlp`` plain
    (fc1, act, fc2) or gated."""

    def __init__(
        self, hidden_size: int, num_heads: int, intermediate_size: int, hidden_act: str, norm_eps: float,
        norm: str = "layernorm", mlp: str = "plain",
    ) -> None:
        super().__init__()
        if mlp not in ("plain", "gated"):
            raise ValueError(f"mlp must be 'plain' or 'gated', got {mlp!r}")
        self.norm1 = encoder_norm(norm, hidden_size, norm_eps)
        self.attn = EncoderAttention(hidden_size, num_heads)
        self.norm2 = encoder_norm(norm, hidden_size, norm_eps)
        mlp_cls = GatedEncoderMLP if mlp == "gated" else EncoderMLP
        self.mlp = mlp_cls(hidden_size, intermediate_size, hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seq)
        return x + self.mlp(self.norm2(x))

    @staticmethod
    def matmul_params(hidden_size: int, intermediate_size: int, mlp: str = "plain") -> int:
        """Weights one token multiplies through in a block (biases and norms excluded)."""
        return 4 * hidden_size**2 + (3 if mlp == "gated" else 2) * hidden_size * intermediate_size


def held_rows(share: RowShare | None, total: int, rows_per_feature: int) -> slice:
    """The rows of a ``total``-row sequence this call runs: all of them, or ``share``'s (a
    sequence-parallel run, see ``veomni.contract.media.ShardableEncoder``), checked to lie inside the
    sequence on feature boundaries."""
    if share is None:
        return slice(0, total)
    if not 0 <= share.start <= share.stop <= total or share.start % rows_per_feature or share.stop % rows_per_feature:
        raise ValueError(f"row share [{share.start}, {share.stop}) must lie within the {total} sequence rows "
                         f"and start and end on multiples of {rows_per_feature} (rows per output feature)")
    return slice(share.start, share.stop)


@torch.no_grad()
def init_encoder_weights(model: nn.Module, std: float, generator: torch.Generator | None = None) -> None:
    """Normal(0, std) for linear and conv weights, zero biases, LayerNorms to ones/zeros, in
    ``modules()`` order, so the same generator state gives the same weights."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            nn.init.normal_(module.weight, 0.0, std, generator=generator)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            module.reset_parameters()
