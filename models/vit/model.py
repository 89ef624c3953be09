"""Native-resolution ViT (Seed-ViT style): packed variable-size images, 2D RoPE, 2x2 merge adapter.

Images of different sizes are packed into one row of patches (``processing.py`` fixes the
order); attention runs within each image, or each video frame, and never across them (the
``attn_fn`` injection point, default ``bidirectional_varlen_attention``). Each patch is
rotated by its (row, col) in its image. After the last block, every ``merge_size x merge_size``
group of neighbouring patches is pooled into one token and a 2-layer MLP maps it to the LLM
width. Plain single-device PyTorch; the engine parallelises it through ``parallel_plan()``, and
may run one large input over several ranks, each on a share of its rows (whole merge groups;
``forward(..., share=)``, see ``veomni.contract.media.ShardableEncoder``).

With ``window_size`` set (Qwen2.5-VL) the patch rows are taken window by window
(``processing.window_order``), so that each window is one contiguous attention segment; layers in
``full_attention_layers`` attend within whole frames instead (a frame's windows stay inside it, so
frame segments are unchanged by the reorder), and the merged tokens are put back in input order at
the end. Transformers reorders right after the patch embedding, which works row by row, so
imported weights compute the same features. A share is cut from the window-ordered rows (a run of
whole windows, the segments at its edges completed by the other ranks' rows during attention) and
returns its tokens in window order (``share_order``); the engine restores input order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from models.common.encoder import EncoderBlock, encoder_norm, held_rows, init_encoder_weights
from veomni.contract.media import ShardableEncoder
from veomni.contract.plan import ParallelPlan
from veomni.ops.attention import RowShare, SeqInfo
from veomni.ops.rope import rope_2d_cos_sin

from .config import ViTConfig
from .processing import patch_positions, window_order


class MergeAdapter(nn.Module):
    """Norm (LayerNorm or RMSNorm, as the blocks), pool each ``m * m`` group of consecutive
    patches (mean or concat), 2-layer MLP."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.group = cfg.merge_size**2
        self.mode = cfg.merge_mode
        self.norm = encoder_norm(cfg.norm, cfg.hidden_size, cfg.norm_eps)
        self.fc1 = nn.Linear(cfg.merged_dim, cfg.adapter_width)
        self.fc2 = nn.Linear(cfg.adapter_width, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        groups = self.norm(x).view(-1, self.group, x.shape[-1])
        merged = groups.mean(dim=1) if self.mode == "avg" else groups.flatten(1)
        return self.fc2(F.gelu(self.fc1(merged)))


class NativeResolutionViT(ShardableEncoder, nn.Module):
    """Packed patches [N, C*p*p] of images/videos with ``grid_thw`` [n, 3] -> [N / m^2, out_hidden_size]."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        cfg.validate()
        self.config = cfg
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.hidden_size, bias=False)
        self.blocks = nn.ModuleList(
            EncoderBlock(cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.hidden_act, cfg.norm_eps,
                         cfg.norm, cfg.mlp)
            for _ in range(cfg.num_layers)
        )
        self.merger = MergeAdapter(cfg)

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor, share: RowShare | None = None) -> torch.Tensor:
        """Attention segments are single frames: an image, or one frame of a video (its frames
        are tied together later, by the LLM, through the time index; see docs/vit.md); with
        ``window_size``, windows of a frame except in ``full_attention_layers`` (module docstring).

        ``share``: run only patch rows ``share.start:share.stop`` of the sequence in share order
        (``share_order``: input order, or window order with windows; whole merge groups; the other
        rows are held by the other ranks of a sequence-parallel run) and return their merged tokens
        in that order. Positions, frames and windows are those of the whole input."""
        cfg = self.config
        grid_thw = self._checked_grid(patches, grid_thw)
        rows = held_rows(share, patches.shape[0], self.rows_per_feature)
        windowed = window_order(grid_thw, cfg.merge_size, cfg.window_tokens) if cfg.window_size else None
        held = rows if windowed is None else _patch_rows(windowed[0], self.rows_per_feature)[rows]
        x = self.patch_embed(patches[held].to(self.patch_embed.weight.dtype))
        positions = patch_positions(grid_thw, cfg.merge_size)[held].to(x.device)
        cos, sin = rope_2d_cos_sin(positions[:, 1:], cfg.head_dim, cfg.rope_theta, x.dtype)
        frame_sizes = (grid_thw[:, 1] * grid_thw[:, 2]).repeat_interleave(grid_thw[:, 0])
        frames = SeqInfo(_cumulative(frame_sizes, x.device), int(frame_sizes.max()), share)
        if windowed is None:
            for block in self.blocks:
                x = block(x, cos, sin, frames)
            return self.merger(x)
        order, window_sizes = windowed
        windows = SeqInfo(_cumulative(window_sizes, x.device), int(window_sizes.max()), share)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, frames if i in cfg.full_attention_layers else windows)
        features = self.merger(x)
        return features if share is not None else features[order.to(x.device).argsort()]  # share: share_order

    @property
    def rows_per_feature(self) -> int:
        """Patches per merged token: a share holds whole merge groups."""
        return self.config.merge_size**2

    def sequence_rows(self, inputs: Mapping[str, torch.Tensor]) -> int:
        """Patch rows: ``sum(t * h * w)`` over ``grid_thw``."""
        return int(torch.as_tensor(inputs["grid_thw"], dtype=torch.long).prod(dim=-1).sum())

    def share_order(self, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """With windows, the merged tokens window by window (``processing.window_order``): a share
        is then a run of whole merge groups in window order, and each window or frame is one
        contiguous segment of the sequence every rank attends over. None without windows."""
        cfg = self.config
        if not cfg.window_size:
            return None
        return window_order(torch.as_tensor(inputs["grid_thw"], dtype=torch.long), cfg.merge_size,
                            cfg.window_tokens)[0]

    def _checked_grid(self, patches: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``grid_thw`` as int64 [n, 3]; ValueError naming what does not fit the patches."""
        cfg = self.config
        grid_thw = torch.as_tensor(grid_thw, dtype=torch.long)
        if grid_thw.ndim != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
            raise ValueError(
                f"grid_thw must be [num_images, 3] (t, h, w) with at least one row, got "
                f"{tuple(grid_thw.shape)}"
            )
        if (grid_thw <= 0).any() or (grid_thw[:, 1:] % cfg.merge_size).any():
            raise ValueError(
                f"grid_thw rows need t, h, w > 0 and h, w divisible by merge_size={cfg.merge_size}, "
                f"got {grid_thw.tolist()}"
            )
        expected = int(grid_thw.prod(dim=1).sum())
        if patches.ndim != 2 or patches.shape != (expected, cfg.patch_dim):
            raise ValueError(
                f"patches must be [{expected}, {cfg.patch_dim}] for grid_thw {grid_thw.tolist()}, "
                f"got {tuple(patches.shape)}"
            )
        return grid_thw

    def num_output_tokens(self, grid_thw: torch.Tensor) -> torch.Tensor:
        """Merged tokens per image/video, ``t * gh * gw // merge_size**2`` (LongTensor [n])."""
        return torch.as_tensor(grid_thw, dtype=torch.long).prod(dim=-1) // self.config.merge_size**2

    def parallel_plan(self) -> ParallelPlan:
        """Blocks ``blocks.0``, ``blocks.1``, ...; the adapter and patch embedding stay in the root."""
        return ParallelPlan(
            blocks=("blocks.*",),
            attention=("blocks.*.attn",),
            stages=("patch_embed", "blocks", "merger"),
        )

    @torch.no_grad()
    def init_weights(self, seed_generator: torch.Generator | None = None) -> None:
        """Normal(0, init_std) for linear weights, zero biases, ones/zeros for LayerNorms.

        Reproducible: the same generator state (or global seed when None) gives the same
        weights, in ``named_modules()`` order. The generator must live on the parameters' device.
        """
        init_encoder_weights(self, self.config.init_std, seed_generator)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def training_flops(self, grid_thw: torch.Tensor) -> float:
        """Model FLOPs of forward + backward for one packed batch of images/videos.

        ``6 * weights * tokens`` for the patch embedding and blocks (per patch) and the adapter
        (per merged token), plus attention scores and weighted values over every pair within
        a frame (bidirectional: ``n^2`` pairs), ``12 * layers * hidden * sum(n^2)``; a windowed
        layer counts the pairs within its windows instead.
        """
        cfg = self.config
        grid = torch.as_tensor(grid_thw, dtype=torch.long)
        patches = int(grid.prod(dim=-1).sum())
        frame_sizes = (grid[:, 1] * grid[:, 2]).repeat_interleave(grid[:, 0])
        pairs = int((frame_sizes * frame_sizes).sum()) * cfg.num_layers
        if cfg.window_size:
            window_sizes = window_order(grid, cfg.merge_size, cfg.window_tokens)[1]
            windowed = cfg.num_layers - len(set(cfg.full_attention_layers))
            pairs += (int((window_sizes * window_sizes).sum()) - pairs // cfg.num_layers) * windowed
        block = EncoderBlock.matmul_params(cfg.hidden_size, cfg.intermediate_size, cfg.mlp)
        per_patch = cfg.patch_dim * cfg.hidden_size + cfg.num_layers * block
        adapter = cfg.merged_dim * cfg.adapter_width + cfg.adapter_width * cfg.out_hidden_size
        merged = patches // cfg.merge_size**2
        attention = 12 * cfg.hidden_size * pairs
        return float(6 * (per_patch * patches + adapter * merged) + attention)


def _cumulative(sizes: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``cu_seqlens`` (int32 [n+1]) of segments of these sizes."""
    return F.pad(sizes.cumsum(0), (1, 0)).to(device=device, dtype=torch.int32)


def _patch_rows(order: torch.Tensor, group: int) -> torch.Tensor:
    """The patch rows of merge groups ``order`` (each group's ``group`` consecutive rows), in that order."""
    return (order[:, None] * group + torch.arange(group, device=order.device)).flatten()
