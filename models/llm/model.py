"""Decoder-only LM (Llama / Qwen2 / Qwen3, and their MoE variants) over packed, padding-free rows.

Plain single-device PyTorch: the engine applies parallelism from outside through
``parallel_plan()``, the ``attn_fn`` injection point of every ``Attention`` and the
``dispatcher`` / ``reduce_load`` injection points of every ``MoE`` (see ``moe.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from veomni.contract.hooks import AttentionSpec
from veomni.contract.plan import ParallelPlan
from veomni.ops.attention import SeqInfo, varlen_attention
from veomni.ops.norm import RMSNorm
from veomni.ops.rope import apply_rope, mrope_cos_sin, rope_cos_sin, rope_inv_freq

from .config import LLMConfig
from .moe import GroupedExperts, MoE, MoEHost, Router

CHECKPOINTING_MODES = ("none", "selective", "full")


class Attention(nn.Module):
    """GQA self-attention; optional q/k biases (Qwen2) and per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.dim_per_head
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.attn_fn = varlen_attention

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(self.num_heads, self.num_kv_heads, self.head_dim, causal=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq: SeqInfo) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, cos, sin)
        out = self.attn_fn(q, k, v, seq)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LLMConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        width = intermediate_size or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def build_ffn(cfg: LLMConfig) -> nn.Module:
    """A block's FFN: the dense SwiGLU ``MLP``, or an ``MoE`` when ``cfg.num_experts > 0``."""
    if not cfg.is_moe:
        return MLP(cfg)
    shared = MLP(cfg, cfg.shared_expert_intermediate_size) if cfg.shared_expert_intermediate_size else None
    return MoE(cfg, shared)


def run_ffn(ffn: nn.Module, x: torch.Tensor, valid_tokens: int | None) -> torch.Tensor:
    """A block's FFN on rows ``x``: an ``MoE`` routes only the first ``valid_tokens`` (the rest is
    padding, see ``MoE.forward``); a dense MLP treats every row alike."""
    return ffn(x, valid_tokens) if isinstance(ffn, MoE) else ffn(x)


@torch.no_grad()
def init_standard_weights(root: nn.Module, std: float, generator: torch.Generator | None = None) -> None:
    """Normal(0, std) for linears, embeddings, expert weights and routers; zero biases and
    expert-selection biases; norms reset. Draws in ``modules()`` order, so the same generator
    state (or global seed when None) gives the same weights; the generator must live on the
    parameters' device."""
    for module in root.modules():
        if isinstance(module, GroupedExperts):
            for param in (module.gate_up_proj, module.down_proj):
                nn.init.normal_(param, 0.0, std, generator=generator)
        elif isinstance(module, Router):
            nn.init.normal_(module.weight, 0.0, std, generator=generator)
            module.expert_bias.zero_()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, 0.0, std, generator=generator)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (RMSNorm, nn.GroupNorm)):
            module.reset_parameters()


class DecoderBlock(nn.Module):
    """Pre-norm residual block: attention then MLP (an ``MoE`` when ``cfg.num_experts > 0``)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = build_ffn(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq: SeqInfo,
                valid_tokens: int | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, seq)
        return x + run_ffn(self.mlp, self.mlp_norm(x), valid_tokens)


class DecoderLM(MoEHost, nn.Module):
    """Token ids of one packed row [T] -> next-token logits [T, vocab]."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
        valid_tokens: int | None = None,
    ) -> torch.Tensor:
        """Packed forward: samples are delimited by ``cu_seqlens`` (int32 [n+1]); no batch dim.
        Rows from ``valid_tokens`` on are padding (None = none): MoE layers do not route them."""
        return self.forward_embeddings(self.embed_tokens(input_ids), position_ids, cu_seqlens, max_seqlen,
                                       valid_tokens)

    def forward_embeddings(
        self, x: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
        valid_tokens: int | None = None,
    ) -> torch.Tensor:
        """The decoder on input embeddings [T, hidden] (an omni model splices encoder features
        into the token embeddings first) -> logits [T, vocab].

        ``position_ids`` [T]; with ``mrope_section`` (M-RoPE) [T, 3] (t, h, w) per token, row-major so
        that sequence parallelism slices them with the row; [T] is text alone (t = h = w)."""
        seq = SeqInfo(cu_seqlens, int(max_seqlen))
        cos, sin = self.rotary(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, seq, valid_tokens)
        return self.lm_head(self.norm(x))

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` [T, head_dim] of the row's positions: 1-D RoPE, or M-RoPE with ``mrope_section``."""
        cfg = self.config
        inv_freq = rope_inv_freq(cfg.dim_per_head, cfg.rope_theta, cfg.rope_scaling, device=position_ids.device)
        if cfg.mrope_section is None:
            if position_ids.ndim != 1:
                raise ValueError(f"position_ids must be [T] (this LLM has 1-D RoPE; set mrope_section for "
                                 f"(t, h, w) positions), got {tuple(position_ids.shape)}")
            return rope_cos_sin(position_ids, inv_freq, dtype)
        if position_ids.ndim == 1:
            position_ids = position_ids[:, None].expand(-1, 3)
        return mrope_cos_sin(position_ids, inv_freq, cfg.mrope_section, dtype)

    def parallel_plan(self) -> ParallelPlan:
        """Blocks are ``layers.0``, ``layers.1``, ... (``*`` matches one path segment)."""
        return ParallelPlan(
            blocks=("layers.*",),
            experts=("layers.*.mlp.experts",) if self.config.is_moe else (),
            attention=("layers.*.attn",),
            stages=("embed_tokens", "layers", "norm", "lm_head"),
        )

    def init_weights(self, seed_generator: torch.Generator | None = None) -> None:
        """``init_standard_weights`` with the config's ``init_std``."""
        init_standard_weights(self, self.config.init_std, seed_generator)

    def num_params(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def _matmul_params(self) -> int:
        """Weights that take part in a matmul per token: every linear incl. lm_head, no embedding.

        For MoE layers only the *activated* ones: the router, the k selected experts and the
        shared expert (the E - k other experts do no work for this token).
        """
        cfg = self.config
        return cfg.num_layers * cfg.block_matmul_params() + cfg.hidden_size * cfg.vocab_size

    def training_flops(self, seq_lens: Sequence[int]) -> float:
        """Model FLOPs of forward + backward for one packed micro-batch of these sample lengths.

        ``6 * matmul_params * tokens`` (lm_head included, embedding lookup excluded, biases and
        element-wise ops ignored) plus attention scores and weighted values over the causal
        pairs, ``12 * layers * heads * head_dim * sum(len * (len + 1) / 2)``: the work a causal
        kernel does. Counting full squares (the PaLM convention) would report more than 100%
        MFU at long context, where attention dominates.
        """
        cfg = self.config
        tokens = sum(seq_lens)
        pairs = sum(n * (n + 1) // 2 for n in seq_lens)
        attention = 12 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head * pairs
        return float(6 * self._matmul_params() * tokens + attention)

    def activation_bytes_per_token(self, bytes_per_elem: int, checkpointing: str) -> float:
        """Estimated activation memory saved for backward, per token, for the whole model.

        With h = hidden, q = heads*head_dim, kv = kv_heads*head_dim, i = intermediate, per block:
          none:      4h + 2q + 2kv + 4i (+ q + kv with qk_norm): both norms' inputs and outputs,
                     q/k/v after RoPE, attention output, SwiGLU gate, up, silu(gate), product.
          selective: 2h + 2q + 2kv + 2i: block input, mid-block residual and the matmul /
                     attention outputs; norms and SwiGLU element-wise ops are recomputed.
          full:      h per block (its input), plus one block's "none" set live during recompute.
        Plus the head, for every mode: final norm input and output (2h) and the logits with the
        softmax the loss keeps (2 * vocab). Small fp32 statistics (rstd, logsumexp) are ignored.
        """
        if checkpointing not in CHECKPOINTING_MODES:
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING_MODES}, got {checkpointing!r}")
        cfg = self.config
        h, i = cfg.hidden_size, cfg.intermediate_size
        if cfg.is_moe:  # the k routed experts act as one MLP of width k*I; their gathered inputs and
            # weighted outputs (2*k*h) are extra, kept in every mode but "full"
            i = cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size
            h_moe = 2 * cfg.num_experts_per_tok * h
        else:
            h_moe = 0
        q, kv = cfg.num_heads * cfg.dim_per_head, cfg.num_kv_heads * cfg.dim_per_head
        block_none = 4 * h + 2 * q + 2 * kv + 4 * i + (q + kv if cfg.qk_norm else 0) + h_moe
        per_block = {
            "none": cfg.num_layers * block_none,
            "selective": cfg.num_layers * (2 * h + 2 * q + 2 * kv + 2 * i + h_moe),
            "full": cfg.num_layers * h + block_none,
        }[checkpointing]
        head = 2 * h + 2 * cfg.vocab_size
        return float(bytes_per_elem * (per_block + head))
