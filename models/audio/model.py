"""Audio encoder: packed log-mel clips -> conv stem -> bidirectional transformer -> LLM width.

Clips of different lengths are concatenated along time (``lengths`` says where each ends).
The stem (two kernel-3 conv1d + GELU, total stride 1, 2 or 4) runs on the clips zero-padded to
a batch, which is exactly per-clip convolution with zero padding; the valid outputs are
packed again. The transformer attends within each clip only (``attn_fn``, default
``bidirectional_varlen_attention``) with 1D RoPE positions restarting at 0 in every clip, then a
LayerNorm and a linear layer map each token to the LLM width. Plain single-device PyTorch; a
long clip may run over several ranks, each on a share of the tokens (``forward(..., share=)``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from models.common.encoder import EncoderBlock, held_rows, init_encoder_weights
from veomni.contract.media import ShardableEncoder
from veomni.contract.plan import ParallelPlan
from veomni.ops.attention import RowShare, SeqInfo
from veomni.ops.rope import rope_cos_sin, rope_inv_freq

from .config import AudioEncoderConfig

KERNEL = 3


class AudioEncoder(ShardableEncoder, nn.Module):
    """features [total_frames, n_mels] + lengths [num_clips] -> [sum(num_output_tokens), out_hidden_size]."""

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.conv1 = nn.Conv1d(
            cfg.n_mels, cfg.hidden_size, KERNEL, stride=cfg.conv_strides[0], padding=KERNEL // 2
        )
        self.conv2 = nn.Conv1d(
            cfg.hidden_size, cfg.hidden_size, KERNEL, stride=cfg.conv_strides[1], padding=KERNEL // 2
        )
        self.blocks = nn.ModuleList(
            EncoderBlock(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.hidden_act, cfg.norm_eps)
            for _ in range(cfg.num_layers)
        )
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.proj = nn.Linear(cfg.hidden_size, cfg.out_hidden_size)

    def forward(self, features: torch.Tensor, lengths: torch.Tensor, share: RowShare | None = None) -> torch.Tensor:
        """``share``: run the transformer on tokens ``share.start:share.stop`` only (the other
        ranks of a sequence-parallel run hold the rest) and return their features. The stem still
        runs on the whole input: each conv output mixes three neighbouring frames (after both
        convs, seven), so a share cut from the frames would need halo frames from its neighbours
        and the exact zero padding at clip ends; the stem is a small part of
        the encoder's work (two convs against the blocks' attention and MLPs), so every member
        recomputing it is the simple, exact choice. Its gradient is still counted once: each
        member's stem receives gradient only through its own tokens."""
        cfg = self.config
        lengths = self._checked_lengths(features, lengths)
        out_lengths = self.num_output_tokens(lengths)
        clips = pad_sequence(features.to(self.conv1.weight.dtype).split(lengths.tolist()), batch_first=True)
        hidden = F.gelu(self.conv1(clips.transpose(1, 2)))  # [B, d, L1]
        # conv2 must see zeros past each clip's end, as a per-clip conv would (conv1 of the zero
        # padding is gelu(bias), not zero)
        conv1_lengths = cfg.conv_output_length(lengths, layers=1)
        hidden = hidden * self._valid(conv1_lengths, hidden.shape[2], hidden.device)[:, None]
        hidden = F.gelu(self.conv2(hidden)).transpose(1, 2)  # [B, L2, d]
        x = hidden[self._valid(out_lengths, hidden.shape[1], hidden.device)]  # packed, clip after clip
        rows = held_rows(share, x.shape[0], self.rows_per_feature)
        x = x[rows]
        positions = torch.cat([torch.arange(n, device=x.device) for n in out_lengths.tolist()])[rows]
        cos, sin = rope_cos_sin(
            positions, rope_inv_freq(cfg.head_dim, cfg.rope_theta, device=x.device), x.dtype
        )
        cu_seqlens = F.pad(out_lengths.cumsum(0), (1, 0)).to(device=x.device, dtype=torch.int32)
        seq = SeqInfo(cu_seqlens, int(out_lengths.max()), share)
        for block in self.blocks:
            x = block(x, cos, sin, seq)
        return self.proj(self.norm(x))

    def _checked_lengths(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        lengths = torch.as_tensor(lengths, dtype=torch.long).cpu()
        if lengths.ndim != 1 or lengths.numel() == 0 or (lengths <= 0).any():
            raise ValueError(
                f"lengths must be a non-empty 1-D tensor of positive frame counts, got {lengths.tolist()}"
            )
        if features.ndim != 2 or features.shape != (int(lengths.sum()), self.config.n_mels):
            raise ValueError(
                f"features must be [{int(lengths.sum())}, {self.config.n_mels}] (sum of lengths, n_mels), "
                f"got {tuple(features.shape)}"
            )
        return lengths

    @staticmethod
    def _valid(lengths: torch.Tensor, width: int, device: torch.device) -> torch.Tensor:
        """[B, width] mask of the positions before each clip's length."""
        return torch.arange(width, device=device) < lengths.to(device)[:, None]

    rows_per_feature = 1
    """One feature per transformer token: any token boundary splits the clip."""

    def sequence_rows(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Transformer tokens: the stem's output length summed over the clips."""
        return int(self.num_output_tokens(inputs["lengths"]).sum())

    def num_output_tokens(self, lengths: torch.Tensor) -> torch.Tensor:
        """Tokens per clip after the stem: ``ceil(ceil(frames / s1) / s2)`` (LongTensor [num_clips])."""
        return self.config.conv_output_length(torch.as_tensor(lengths, dtype=torch.long))

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(
            blocks=("blocks.*",),
            attention=("blocks.*.attn",),
            stages=("conv1", "conv2", "blocks", "norm", "proj"),
        )

    @torch.no_grad()
    def init_weights(self, seed_generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) for linear and conv weights, zero biases, LayerNorms to ones/zeros;
        reproducible from the generator state (or global seed when None)."""
        init_encoder_weights(self, self.config.init_std, seed_generator)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def training_flops(self, lengths: torch.Tensor) -> float:
        """Model FLOPs of forward + backward for one packed batch of clips of these frame counts:
        ``6 * weights * outputs`` for each conv (per output frame), the blocks and the
        projection (per token), plus ``12 * layers * hidden * sum(n^2)`` for bidirectional
        attention within each clip. Padding the stem computes for the shorter clips is not counted."""
        cfg = self.config
        lengths = torch.as_tensor(lengths, dtype=torch.long)
        after_conv1, tokens = cfg.conv_output_length(lengths, layers=1), cfg.conv_output_length(lengths)
        conv1 = cfg.n_mels * KERNEL * cfg.hidden_size * int(after_conv1.sum())
        conv2 = cfg.hidden_size * KERNEL * cfg.hidden_size * int(tokens.sum())
        per_token = (
            cfg.num_layers * EncoderBlock.matmul_params(cfg.hidden_size, cfg.intermediate_size)
            + cfg.hidden_size * cfg.out_hidden_size
        )
        attention = 12 * cfg.num_layers * cfg.hidden_size * int((tokens * tokens).sum())
        return float(6 * (conv1 + conv2 + per_token * int(tokens.sum())) + attention)
