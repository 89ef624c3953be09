"""A packed row (``veomni.tasks.flow`` contract) from whole latents, and per-sample outputs back.

For inference and tests: the sampler and ``DiTModel.forward_video`` hand the model a few
latents at a time; training rows come from the ``video_latents`` dataset kind.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from veomni.ops.video_patch import grid_positions, patch_grid, patchify, unpatchify


def _boundaries(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


def pack_latents(latents: Sequence[torch.Tensor], texts: Sequence[torch.Tensor], timesteps: torch.Tensor,
                 patch: tuple[int, int, int], images: Sequence[torch.Tensor] | None = None) -> dict:
    """One row of the latents [C, F, H, W] (any mix of sizes), their captions' text states
    [L_i, text_dim] and timesteps [n]; ``latents`` holds the patch tokens (the model's input).
    ``images``: each sample's image encoder states [L_i, image_dim] (zero rows: no image)."""
    if not len(latents) == len(texts) == len(timesteps) == len(latents if images is None else images):
        raise ValueError(f"{len(latents)} latents, {len(texts)} text states, {len(timesteps)} timesteps and "
                         f"{'no' if images is None else len(images)} image states: give one of each per sample")
    device = latents[0].device
    grids = [patch_grid(latent.shape, patch) for latent in latents]
    lengths = [f * h * w for f, h, w in grids]
    image_fields = {} if images is None else {
        "image_states": torch.cat(list(images)),
        "image_cu_seqlens": _boundaries([len(image) for image in images], device)}
    return {**image_fields,
        "latents": torch.cat([patchify(latent, patch) for latent in latents]),
        "positions": torch.cat([grid_positions(grid, device) for grid in grids]),
        "sample_index": torch.repeat_interleave(torch.arange(len(latents), device=device),
                                                torch.tensor(lengths, device=device)),
        "cu_seqlens": _boundaries(lengths, device),
        "max_seqlen": max(lengths),
        "grid": torch.tensor(grids, dtype=torch.int64, device=device),
        "text_states": torch.cat(list(texts)),
        "text_cu_seqlens": _boundaries([len(text) for text in texts], device),
        "timesteps": timesteps.float().to(device),
    }


def unpack_tokens(tokens: torch.Tensor, batch: dict, patch: tuple[int, int, int]) -> list[torch.Tensor]:
    """Each sample's [C, F, H, W] from a row's per-token output [T, P]."""
    bounds = batch["cu_seqlens"].tolist()
    return [unpatchify(tokens[start:end], tuple(grid), patch)
            for start, end, grid in zip(bounds[:-1], bounds[1:], batch["grid"].tolist())]
