"""The pieces of a VWN: hyper-connected blocks, the output reduce, the next-2-token head.

Blocks reuse the decoder's attention and FFN (``models.llm.model``) unchanged, with the same
parameter names (``attn_norm``, ``attn``, ``mlp_norm``, ``mlp``), so an LLM's weights load into
a VWN by name. The FFN is the decoder's: dense SwiGLU, or MoE when ``num_experts > 0``.
"""

from __future__ import annotations

import torch
from torch import nn

from models.llm.model import Attention, build_ffn, run_ffn
from veomni.ops.attention import SeqInfo
from veomni.ops.norm import RMSNorm

from .config import VWNConfig
from .hyper_connection import GeneralizedHyperConnection


class VWNBlock(nn.Module):
    """Attention then FFN, each pre-norm and wrapped in its own DGHC (plain residual if disabled)."""

    def __init__(self, cfg: VWNConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = build_ffn(cfg)
        def connection() -> GeneralizedHyperConnection | None:
            if not cfg.hyper_connections:
                return None
            return GeneralizedHyperConnection(cfg.hidden_size, cfg.vwn_m, cfg.vwn_n, cfg.rms_norm_eps)

        self.attn_hc = connection()
        self.mlp_hc = connection()

    @staticmethod
    def _connect(hc: GeneralizedHyperConnection | None, h: torch.Tensor, branch) -> torch.Tensor:
        return h + branch(h) if hc is None else hc(h, branch)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seq: SeqInfo,
                valid_tokens: int | None = None) -> torch.Tensor:
        """Wide state [T, D'] -> wide state [T, D'] (D' = D without hyper-connections); rows from
        ``valid_tokens`` on are padding, which an MoE FFN does not route."""
        h = self._connect(self.attn_hc, h, lambda x: self.attn(self.attn_norm(x), cos, sin, seq))
        return self._connect(self.mlp_hc, h, lambda x: run_ffn(self.mlp, self.mlp_norm(x), valid_tokens))


class WideReduce(nn.Module):
    """``Linear(GroupNorm(H'))``: the final wide state back to the backbone width D.

    GroupNorm has group size D (r groups) and is omitted where the paper omits it (see
    ``VWNConfig.reduce_group_norm``). Without hyper-connections this is the identity.
    """

    def __init__(self, cfg: VWNConfig) -> None:
        super().__init__()
        self.group_norm = (nn.GroupNorm(cfg.wide_dim // cfg.hidden_size, cfg.wide_dim, eps=cfg.rms_norm_eps)
                           if cfg.use_group_norm else None)
        self.proj = nn.Linear(cfg.wide_dim, cfg.hidden_size, bias=False) if cfg.hyper_connections else None

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Reduce = read the first m slots ([I_D | 0]), like the read map Å's static initialisation.

        The paper does not state this initialisation; this choice makes a VWN with its dynamic
        parts at zero compute exactly a pre-norm decoder on the first D dims of its embedding.
        """
        if self.group_norm is not None:
            self.group_norm.reset_parameters()
        if self.proj is not None:
            self.proj.weight.zero_()
            self.proj.weight[:, : self.proj.out_features].copy_(torch.eye(self.proj.out_features))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.group_norm is not None:
            h = self.group_norm(h)
        return self.proj(h) if self.proj is not None else h


class NextTwoTokenHead(nn.Module):
    """The MTP module of VWN (paper Sec. 3.4), depth 1, DeepSeek-V3 style.

    At position i the final wide state (which predicted token i+1) and the wide embedding of
    token i+1 are split into their n slots of D/m; one shared block linear (2D/m -> D/m) mixes
    each slot pair (RMSNorm on both, as DeepSeek-V3), then one extra hyper-connected block and
    its own reduce and final norm give the hidden state whose logits (shared unembedding)
    predict token i+2. The block linear keeps the mix at the r = 1 cost instead of 2rD -> rD.
    """

    def __init__(self, cfg: VWNConfig) -> None:
        super().__init__()
        d = cfg.block_dim
        self.n, self.d = cfg.vwn_n, d
        self.state_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.embed_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.mix = nn.Linear(2 * d, d, bias=False)
        self.block = VWNBlock(cfg)
        self.reduce = WideReduce(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, state: torch.Tensor, next_embed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seq: SeqInfo, valid_tokens: int | None = None) -> torch.Tensor:
        """Wide final state and wide next-token embeddings [T, D'] -> normalised hidden [T, D]."""
        tokens = state.shape[0]
        pairs = torch.cat([self.state_norm(state.reshape(tokens, self.n, self.d)),
                           self.embed_norm(next_embed.reshape(tokens, self.n, self.d))], dim=-1)
        h = self.mix(pairs).reshape(tokens, self.n * self.d)
        return self.norm(self.reduce(self.block(h, cos, sin, seq, valid_tokens)))
