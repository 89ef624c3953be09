"""Cost model of the DiT over packed rows of latent patches (units: patch tokens).

Forward FLOPs (multiply-add = 2), with D = heads x head_dim, F = ffn_dim, L = layers, per sample
i of len_i patches and s_i text tokens:

- per patch token: patch embedding 2 P D, per layer self-attention q/k/v/out 8 D^2, cross-attention
  q/out 4 D^2, FFN 4 D F, and the output projection 2 D P_out;
- per text token: the text projection 2 text_dim D + 2 D^2, and per layer the cross-attention k/v
  4 D^2;
- per sample: the timestep MLP and modulation projection 2 freq D + 2 D^2 + 12 D^2;
- per image token (image-to-video, ``image_dim`` = I): the image projection 2 I^2 + 2 I D, and
  per layer the image key/value projections 4 D^2;
- attention, per layer: scores and weighted values 4 D len_i^2 (bidirectional, full squares)
  plus 4 D len_i (s_i + m_i) for cross-attention to the caption and the m_i image tokens.

Norms, modulation and activations (element-wise) are not counted. Training is 3 x forward. A
row's numbers come from its global ``cu_seqlens`` / ``text_cu_seqlens`` (padding is not
counted), so a sequence-parallel slice reports the whole row, as the engine expects.
``--dry-run`` has no captions: it assumes ``text_len`` text tokens per sample (config field), and
``image_len`` image tokens for an image-to-video model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from veomni.ops.video_patch import patch_grid

from .config import DiTConfig

CHECKPOINTING_MODES = ("none", "selective", "full")
# 720p, 5 s at Wan's 16 fps (81 frames) through Wan's VAE: 4x temporal (plus the first frame),
# 8x spatial, 16 latent channels.
WAN_720P_5S_LATENT = (16, 21, 90, 160)


def forward_flops(cfg: DiTConfig, lengths: Sequence[int], text_lengths: Sequence[int],
                  image_lengths: Sequence[int] | None = None) -> float:
    """Forward FLOPs of one row of samples with these patch, text and image lengths (module docstring)."""
    d, layers = cfg.hidden_size, cfg.num_layers
    image_lengths = [0] * len(lengths) if image_lengths is None else image_lengths
    per_token = 2 * cfg.patch_dim * d + layers * (12 * d * d + 4 * d * cfg.ffn_dim) + 2 * d * cfg.out_patch_dim
    per_text = 2 * cfg.text_dim * d + 2 * d * d + layers * 4 * d * d
    per_image = 0 if cfg.image_dim is None else 2 * cfg.image_dim * (cfg.image_dim + d) + layers * 4 * d * d
    per_sample = 2 * cfg.freq_dim * d + 14 * d * d
    contexts = [s + m for s, m in zip(text_lengths, image_lengths, strict=True)]
    pairs = sum(n * n for n in lengths) + sum(n * c for n, c in zip(lengths, contexts, strict=True))
    return float(sum(lengths) * per_token + sum(text_lengths) * per_text + sum(image_lengths) * per_image
                 + len(lengths) * per_sample + layers * 4 * d * pairs)


def _nominal_image_len(cfg: DiTConfig) -> int:
    return 0 if cfg.image_dim is None else cfg.image_len


class DiTCost:
    """The engine's ``CostModel`` for ``DiTModel``; reads only ``model.config``."""

    def batch_flops(self, model: nn.Module, batch: Mapping[str, Any]) -> float:
        lengths = batch["cu_seqlens"].diff().tolist()
        images = batch["image_cu_seqlens"].diff().tolist() if "image_cu_seqlens" in batch else None
        return 3 * forward_flops(model.config, lengths, batch["text_cu_seqlens"].diff().tolist(), images)

    def sample_flops(self, model: nn.Module, units: int) -> float:
        cfg = model.config
        return 3 * forward_flops(cfg, [units], [cfg.text_len], [_nominal_image_len(cfg)])

    def activation_bytes_per_unit(self, model: nn.Module, bytes_per_elem: int, checkpointing: str) -> float:
        """Per patch token, kept for backward. With D and F as above, per block:
          none:      20 D + 2 F: the three norms' inputs and modulated outputs (6 D), q/k before and
                     after their norm and after RoPE, v, the attention output (8 D), cross-attention
                     q before and after its norm and its output (3 D), the FFN's hidden before and
                     after GELU (2 F), the two gated branch outputs and the cross-attention
                     projection input (3 D);
          selective: 9 D + F: the block input, q/k/v and the attention output, cross q and output,
                     the three output projections (mm outputs are kept, element-wise is recomputed);
          full:      D per block (its input) plus one block's ``none`` set during its recompute.
        An image branch (``image_dim``) adds its attention output, D per block in ``none`` and
        ``selective`` (its keys and values are per image token, like the text's, not counted).
        Always, in fp32 whatever the compute dtype: the per-token modulation backward keeps, the
        two branches' scale and gate, 4 D per block in ``none``/``selective`` (recomputed in
        ``full``, where one block's counts), and the head's scale D; plus the patch embedding
        output and the head's norm in/out (3 D) and the input and output patch (P + P_out). Text
        tokens' activations are not counted."""
        if checkpointing not in CHECKPOINTING_MODES:
            raise ValueError(f"checkpointing must be one of {CHECKPOINTING_MODES}, got {checkpointing!r}")
        cfg = model.config
        d, f, layers = cfg.hidden_size, cfg.ffn_dim, cfg.num_layers
        image = 0 if cfg.image_dim is None else d
        block_none = 20 * d + 2 * f + image
        kept = {"none": layers * block_none, "selective": layers * (9 * d + f + image),
                "full": layers * d + block_none}[checkpointing]
        fp32_modulation = 4 * d * (1 if checkpointing == "full" else layers) + d
        ends = 3 * d + cfg.patch_dim + cfg.out_patch_dim
        return float(bytes_per_elem * (kept + ends) + 4 * fp32_modulation)

    def activated_params(self, model: nn.Module) -> int:
        """Every parameter: each token goes through every layer."""
        return sum(p.numel() for p in model.parameters())

    def report_lines(self, model: nn.Module, units: int) -> list[str]:
        cfg: DiTConfig = model.config
        c, f, h, w = WAN_720P_5S_LATENT
        try:
            grid = patch_grid((cfg.in_channels, f, h, w), cfg.patch_size)
        except ValueError:
            return []
        tokens = grid[0] * grid[1] * grid[2]
        images = _nominal_image_len(cfg)
        total = forward_flops(cfg, [tokens], [cfg.text_len], [images])
        attention = cfg.num_layers * 4 * cfg.hidden_size * tokens * (tokens + cfg.text_len + images)
        return [
            f"a 720p 5 s clip (81 frames of 1280x720 at 16 fps) through Wan's VAE (4x time, 8x space) is a "
            f"{c}x{f}x{h}x{w} latent: {tokens:,} patch tokens at patch {list(cfg.patch_size)} "
            f"(grid {grid[0]}x{grid[1]}x{grid[2]})",
            f"one such clip with a {cfg.text_len}-token caption"
            + (f" and {images} image tokens" if images else "") + f": {3 * total:.3e} training FLOPs, "
            f"{100 * attention / total:.0f}% of them in attention scores",
            f"this sample of {units:,} patches has {units / tokens:.2f}x the patches of that clip",
        ]
