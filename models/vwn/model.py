"""Virtual Width Network LM over packed, padding-free rows (VWN paper, Algorithm 1).

over-width embedding (n slots of D/m) -> L blocks, each attention and FFN wrapped in a dynamic
generalized hyper-connection -> GroupNorm + linear reduce to D -> final RMSNorm -> unembedding;
optionally the next-2-token head. Plain single-device PyTorch like ``models.llm``: the engine
parallelises it through ``parallel_plan()`` and each attention's ``attn_fn``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.llm.model import DecoderLM, init_standard_weights
from models.llm.moe import MoEHost
from veomni.contract.plan import ParallelPlan
from veomni.ops.attention import SeqInfo
from veomni.ops.norm import RMSNorm
from veomni.ops.rope import rope_cos_sin, rope_inv_freq

from .blocks import NextTwoTokenHead, VWNBlock, WideReduce
from .config import VWNConfig
from .hyper_connection import GeneralizedHyperConnection, static_beta


class VWNLM(MoEHost, nn.Module):
    """Token ids of one packed row [T] -> next-token logits [T, vocab] (and next-2-token logits)."""

    def __init__(self, cfg: VWNConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        table_dim = cfg.hidden_size if cfg.factorized_embedding else cfg.wide_dim
        self.embed_tokens = nn.Embedding(cfg.vocab_size, table_dim)
        self.embed_expand = (nn.Linear(cfg.hidden_size, cfg.wide_dim, bias=False)
                             if cfg.factorized_embedding else None)
        self.layers = nn.ModuleList(VWNBlock(cfg) for _ in range(cfg.num_layers))
        self.reduce = WideReduce(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = NextTwoTokenHead(cfg) if cfg.mtp else None
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Over-width embedding [T, D'] (a D'-wide table, or the factorised ``W_expand E_base``)."""
        e = self.embed_tokens(input_ids)
        return self.embed_expand(e) if self.embed_expand is not None else e

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, mtp: bool = False, next_ids: torch.Tensor | None = None,
                valid_tokens: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Packed forward. ``mtp=True`` also returns next-2-token logits: row i predicts token i+2
        of the same sample (rows at a sample's last position are meaningless and must be masked).
        ``next_ids`` (token i+1 for row i) defaults to the row shifted by one; pass it when the
        row is a slice of a longer one (sequence parallelism), whose next token lies outside.
        Rows from ``valid_tokens`` on are padding (None = none): MoE FFNs do not route them."""
        seq = SeqInfo(cu_seqlens, int(max_seqlen))
        h = self.embed(input_ids)
        inv_freq = rope_inv_freq(self.config.dim_per_head, self.config.rope_theta, self.config.rope_scaling,
                                 device=h.device)
        cos, sin = rope_cos_sin(position_ids, inv_freq, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, seq, valid_tokens)
        logits = self.lm_head(self.norm(self.reduce(h)))
        if not mtp:
            return logits
        if self.mtp is None:
            raise ValueError("mtp=True needs a model built with mtp: true")
        # Token i+1 feeds row i; a sample's last row gets the next sample's first token, which
        # cannot leak: attention stays inside the sample and that row's target is masked.
        if next_ids is None:
            next_ids = torch.cat([input_ids[1:], input_ids[-1:]])
        return logits, self.lm_head(self.mtp(h, self.embed(next_ids), cos, sin, seq, valid_tokens))

    def parallel_plan(self) -> ParallelPlan:
        """Blocks are the hyper-connected layers (their wide state is per token, so sequence
        parallelism may split it like the plain residual); the MTP block is one more block."""
        mtp = ("mtp.block",) if self.mtp is not None else ()
        return ParallelPlan(
            blocks=("layers.*", *mtp),
            experts=tuple(f"{b}.mlp.experts" for b in ("layers.*", *mtp)) if self.config.is_moe else (),
            attention=("layers.*.attn", *(f"{b}.attn" for b in mtp)),
            stages=("embed_tokens", *(("embed_expand",) if self.embed_expand is not None else ()),
                    "layers", "reduce", "norm", "lm_head", *(("mtp",) if mtp else ())),
        )

    @torch.no_grad()
    def init_weights(self, seed_generator: torch.Generator | None = None) -> None:
        """The decoder's ``init_standard_weights``, then the structured parts:
        every DGHC to the paper's static/dynamic initialisation, the reduce to read the first m
        slots, and a factorised ``W_expand`` to tile the base embedding into the n slots (slot j
        = block j mod m: the hyper-connections paper's "n copies of h^0").
        """
        init_standard_weights(self, self.config.init_std, seed_generator)
        for module in self.modules():  # after the generic pass, which would overwrite their linears
            if isinstance(module, (GeneralizedHyperConnection, WideReduce)):
                module.reset_parameters()
        if self.embed_expand is not None:
            cfg = self.config
            tiles = torch.kron(static_beta(cfg.vwn_m, cfg.vwn_n), torch.eye(cfg.block_dim))  # [D', D]
            self.embed_expand.weight.copy_(tiles)

    def num_params(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    # ----- cost model ----------------------------------------------------------------------
    def flops_breakdown(self, seq_lens: Sequence[int]) -> dict[str, float]:
        """Forward + backward model FLOPs of one packed micro-batch, by part.

        Matmuls count ``6 * weights * tokens`` (only the activated experts of an MoE FFN) and
        attention its causal pairs (the ``DecoderLM`` convention; element-wise ops ignored); each
        DGHC adds its token-dependent map matmuls
        (``GeneralizedHyperConnection.training_flops_per_token``).
        """
        cfg = self.config
        tokens = sum(seq_lens)
        d, wide, hidden = cfg.block_dim, cfg.wide_dim, cfg.hidden_size
        block = cfg.block_matmul_params()
        attention_per_block = 12 * cfg.num_heads * cfg.dim_per_head * sum(n * (n + 1) // 2 for n in seq_lens)
        hc = self.layers[0].attn_hc
        hc_per_block = 2 * hc.training_flops_per_token() * tokens if hc is not None else 0
        reduce = wide * hidden if cfg.hyper_connections else 0
        expand = hidden * wide if cfg.factorized_embedding else 0
        head = hidden * cfg.vocab_size
        parts = {
            "backbone": float(6 * (cfg.num_layers * block + head) * tokens
                              + cfg.num_layers * attention_per_block),
            "virtual_width": float(6 * (reduce + expand) * tokens + cfg.num_layers * hc_per_block),
            "mtp": 0.0,
        }
        if cfg.mtp:
            mix = cfg.vwn_n * 2 * d * d
            # the head embeds the next tokens again (a factorised table expands them again)
            parts["mtp"] = float(6 * (expand + mix + block + reduce + head) * tokens + attention_per_block
                                 + hc_per_block)
        return parts

    def training_flops(self, seq_lens: Sequence[int]) -> float:
        """Model FLOPs of forward + backward for one packed micro-batch (MFU numerator)."""
        return sum(self.flops_breakdown(seq_lens).values())

    def activation_bytes_per_token(self, bytes_per_elem: int, checkpointing: str) -> float:
        """The dense decoder's estimate (``DecoderLM``) plus, per DGHC, what it keeps for backward.

        Per DGHC with w = D' = n*d: none: its input, the normed slots and its output (3w), the
        mixed rows ((m+n)d) and the maps (2n(2m+n)); selective: input, mixed rows and output
        (the einsum outputs); full: each block keeps its D'-wide input instead of a D-wide one.
        The MTP head counts as one more block plus its logits.
        """
        cfg = self.config
        base = DecoderLM.activation_bytes_per_token(self, bytes_per_elem, checkpointing) / bytes_per_elem
        blocks = cfg.num_layers + int(cfg.mtp)
        if cfg.mtp:  # one more block (the layers' average) and one more head
            head = 2 * cfg.hidden_size + 2 * cfg.vocab_size
            base += (base - head) / cfg.num_layers + head
        if cfg.hyper_connections:
            m, n, d, wide = cfg.vwn_m, cfg.vwn_n, cfg.block_dim, cfg.wide_dim
            per_hc = {
                "none": 3 * wide + (m + n) * d + 2 * n * (2 * m + n),
                "selective": 2 * wide + (m + n) * d,
                "full": 0,
            }[checkpointing]
            extra = blocks * 2 * per_hc
            if checkpointing == "full":
                extra += blocks * (wide - cfg.hidden_size)
            extra += 2 * wide  # the final wide state and its GroupNorm output
            base += extra
        return float(bytes_per_elem * base)

    def report_lines(self, seq_len: int) -> list[str]:
        """Extra ``--dry-run`` lines: the parameter and FLOP overhead of the virtual width."""
        cfg = self.config
        hcs = [m for name, m in self.named_modules()
               if isinstance(m, GeneralizedHyperConnection) and not name.startswith("mtp.")]
        hc_params = sum(p.numel() for m in hcs for p in m.parameters())
        embed_extra = self.embed_tokens.weight.numel() - cfg.vocab_size * cfg.hidden_size
        if self.embed_expand is not None:
            embed_extra += self.embed_expand.weight.numel()
        reduce_params = sum(p.numel() for p in self.reduce.parameters())
        mtp_params = sum(p.numel() for p in self.mtp.parameters()) if self.mtp is not None else 0
        vw_params = hc_params + embed_extra + reduce_params
        backbone_params = self.num_params() - vw_params - mtp_params
        flops = self.flops_breakdown([seq_len])
        base = flops["backbone"]
        r = cfg.virtual_width_factor
        return [
            f"virtual width r = n/m = {r} (m={cfg.vwn_m}, n={cfg.vwn_n}): backbone D={cfg.hidden_size}, "
            f"wide state D'={cfg.wide_dim} "
            f"({'factorised' if cfg.factorized_embedding else 'full'} embedding, "
            f"GroupNorm {'on' if cfg.use_group_norm else 'off'})",
            f"  parameters: backbone {backbone_params:,}; virtual width +{vw_params:,} "
            f"(+{100 * vw_params / backbone_params:.2f}%: embedding +{embed_extra:,}, hyper-connections "
            f"+{hc_params:,}, reduce +{reduce_params:,}); MTP head +{mtp_params:,}",
            f"  FLOPs/token: backbone {base / seq_len / 1e9:.3f} G; virtual width "
            f"+{flops['virtual_width'] / seq_len / 1e9:.4f} G (+{100 * flops['virtual_width'] / base:.2f}%); "
            f"MTP head +{flops['mtp'] / seq_len / 1e9:.3f} G (+{100 * flops['mtp'] / base:.2f}%)",
        ]
