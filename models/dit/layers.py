"""The pieces of the DiT: condition embeddings, attention over a packed row, the modulated block.

Numerics follow diffusers' Wan modules so imported weights compute the same function: layer
norms, modulation and gated residuals run in fp32 and cast back (``FP32LayerNorm``, the
``.float()`` calls of ``WanTransformerBlock``), q/k RMSNorm spans all heads, RoPE is interleaved.
Everything outside ``SelfAttention.attn_fn`` works token by token (per-sample tables are
gathered with ``sample_index``), so a sequence-parallel slice of a row computes what the whole
row would for its tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from veomni.contract.hooks import AttentionSpec
from veomni.ops.attention import SeqInfo, bidirectional_varlen_attention, cross_varlen_attention
from veomni.ops.rope import apply_interleaved_rope

from .config import DiTConfig
from .modulation import gated_add, modulate


def layer_norm_fp32(x: torch.Tensor, norm: nn.LayerNorm | None = None, eps: float = 1e-6) -> torch.Tensor:
    """LayerNorm in fp32 (``norm``'s affine weights when given, else none), returned in fp32."""
    if norm is None:
        return F.layer_norm(x.float(), x.shape[-1:], eps=eps)
    return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps)


def timestep_features(timesteps: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features [n, dim] of timesteps [n], cos half first (diffusers' ``Timesteps`` with
    ``flip_sin_to_cos=True, downscale_freq_shift=0``, as Wan uses)."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timesteps.device) / half
    angle = timesteps.float()[:, None] * torch.exp(exponent)[None, :]
    return torch.cat([torch.cos(angle), torch.sin(angle)], dim=-1)


class TwoLayerMLP(nn.Module):
    """``linear_2(act(linear_1(x)))``: diffusers' ``TimestepEmbedding`` (SiLU) and
    ``PixArtAlphaTextProjection`` (tanh GELU)."""

    def __init__(self, in_features: int, width: int, activation: nn.Module) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_features, width)
        self.act = activation
        self.linear_2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class ImageEmbedder(nn.Module):
    """Image encoder states to the model width (diffusers' ``WanImageEmbedding`` without its FLF2V
    position table): fp32 LayerNorm, exact-GELU MLP of width ``image_dim``, fp32 LayerNorm."""

    def __init__(self, image_dim: int, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(image_dim, eps=1e-5)
        self.ff = FeedForward(image_dim, image_dim, dim, approximate="none")
        self.norm2 = nn.LayerNorm(dim, eps=1e-5)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        h = self.ff(layer_norm_fp32(states, self.norm1).to(states.dtype))
        return layer_norm_fp32(h, self.norm2).to(h.dtype)


class ConditionEmbedder(nn.Module):
    """Per-sample timestep embedding and the six modulation vectors of every block; text states
    (and image states, for image-to-video) projected to the model width."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.freq_dim = cfg.freq_dim
        self.time_embedder = TwoLayerMLP(cfg.freq_dim, dim, nn.SiLU())
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = TwoLayerMLP(cfg.text_dim, dim, nn.GELU(approximate="tanh"))
        self.image_embedder = ImageEmbedder(cfg.image_dim, dim) if cfg.image_dim is not None else None

    def time(self, timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(temb [n, D], modulation [n, 6, D])`` of per-sample timesteps [n]."""
        features = timestep_features(timesteps, self.freq_dim)
        temb = self.time_embedder(features.to(self.time_embedder.linear_1.weight.dtype))
        return temb, self.time_proj(F.silu(temb)).unflatten(1, (6, -1))


class SelfAttention(nn.Module):
    """Bidirectional attention within each sample of the row, with q/k RMSNorm across heads and
    3D RoPE. ``attn_fn(q, k, v, seq)`` on [T_local, H, D] is the sequence-parallel injection point."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.num_heads = self.num_kv_heads = cfg.num_attention_heads
        self.head_dim = cfg.attention_head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(dim, eps=cfg.eps)
        self.norm_k = nn.RMSNorm(dim, eps=cfg.eps)
        self.attn_fn = bidirectional_varlen_attention

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim, causal=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        heads = (self.num_heads, self.head_dim)
        q = apply_interleaved_rope(self.norm_q(self.to_q(x)).unflatten(-1, heads), cos, sin)
        k = apply_interleaved_rope(self.norm_k(self.to_k(x)).unflatten(-1, heads), cos, sin)
        v = self.to_v(x).unflatten(-1, heads)
        return self.to_out(self.attn_fn(q, k, v, seq).flatten(-2))


class CrossAttention(nn.Module):
    """Each patch token attends to its own sample's text states (``cross_varlen_attention``). With
    an image branch (``added_kv_proj_dim``) it also attends, with the same query, to its sample's
    projected image states through their own key/value projections, and the two results are
    summed before ``to_out`` (diffusers' ``WanAttnProcessor``). A sample without image states (a
    text-to-video sample in an image-to-video model's row) gets zero from the image attention."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.attention_head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(dim, eps=cfg.eps)
        self.norm_k = nn.RMSNorm(dim, eps=cfg.eps)
        self.add_k_proj = self.add_v_proj = self.norm_added_k = None
        if cfg.added_kv_proj_dim is not None:
            self.add_k_proj = nn.Linear(cfg.added_kv_proj_dim, dim)
            self.add_v_proj = nn.Linear(cfg.added_kv_proj_dim, dim)
            self.norm_added_k = nn.RMSNorm(dim, eps=cfg.eps)

    def forward(self, x: torch.Tensor, sample_index: torch.Tensor, text: torch.Tensor,
                text_cu_seqlens: torch.Tensor, image: torch.Tensor | None = None,
                image_cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        heads = (self.num_heads, self.head_dim)
        q = self.norm_q(self.to_q(x)).unflatten(-1, heads)
        k = self.norm_k(self.to_k(text)).unflatten(-1, heads)
        v = self.to_v(text).unflatten(-1, heads)
        out = cross_varlen_attention(q, k, v, sample_index, text_cu_seqlens)
        if self.add_k_proj is not None:
            k_image = self.norm_added_k(self.add_k_proj(image)).unflatten(-1, heads)
            v_image = self.add_v_proj(image).unflatten(-1, heads)
            out = out + cross_varlen_attention(q, k_image, v_image, sample_index, image_cu_seqlens)
        return self.to_out(out.flatten(-2))


class FeedForward(nn.Module):
    """``fc_out(gelu(fc_in(x)))``, tanh-approximated GELU unless told (``approximate="none"``)."""

    def __init__(self, dim: int, width: int, out_dim: int | None = None, approximate: str = "tanh") -> None:
        super().__init__()
        self.fc_in = nn.Linear(dim, width)
        self.fc_out = nn.Linear(width, dim if out_dim is None else out_dim)
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate=self.approximate))


class DiTBlock(nn.Module):
    """Wan's block: modulated self-attention, cross-attention to the caption, modulated FFN.

    The six per-sample modulation vectors (``scale_shift_table`` + the timestep's projection)
    are shift/scale/gate for self-attention and for the FFN; the gates scale the residual branch.
    """

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.eps = cfg.eps
        self.attn1 = SelfAttention(cfg)
        self.norm2 = nn.LayerNorm(dim, eps=cfg.eps) if cfg.cross_attn_norm else None
        self.attn2 = CrossAttention(cfg)
        self.ffn = FeedForward(dim, cfg.ffn_dim)
        self.scale_shift_table = nn.Parameter(torch.empty(1, 6, dim))

    def forward(self, x: torch.Tensor, modulation: torch.Tensor, sample_index: torch.Tensor, text: torch.Tensor,
                text_cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq: SeqInfo,
                image: torch.Tensor | None = None, image_cu_seqlens: torch.Tensor | None = None,
                table_index: torch.Tensor | None = None) -> torch.Tensor:
        """``table_index`` [T]: each token's row of ``modulation`` (default: its sample's)."""
        per_sample = self.scale_shift_table.float() + modulation.float()
        index = sample_index.clamp(min=0) if table_index is None else table_index
        shift, scale, gate, ffn_shift, ffn_scale, ffn_gate = per_sample.unbind(1)  # [n, D] tables

        h = modulate(layer_norm_fp32(x, eps=self.eps), scale, shift, index).to(x.dtype)
        x = gated_add(x.float(), self.attn1(h, cos, sin, seq), gate, index).to(x.dtype)

        h = x if self.norm2 is None else layer_norm_fp32(x, self.norm2).to(x.dtype)
        x = x + self.attn2(h, sample_index, text, text_cu_seqlens, image, image_cu_seqlens)

        h = modulate(layer_norm_fp32(x, eps=self.eps), ffn_scale, ffn_shift, index).to(x.dtype)
        return gated_add(x.float(), self.ffn(h), ffn_gate, index).to(x.dtype)
