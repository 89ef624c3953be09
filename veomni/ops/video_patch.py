"""Latent video <-> patch tokens, the layout every video-diffusion piece agrees on.

A latent clip ``[C, F, H, W]`` (an image is a clip of one frame) is cut into non-overlapping
``(pt, ph, pw)`` patches. Token order is raster over the patch grid ``(f, h, w)``, ``w``
fastest; each token's vector is flattened ``(c, pt, ph, pw)``, ``pw`` fastest. This is exactly
what a ``Conv3d`` with kernel = stride = patch size sees (its weight flattens as
``[out, c, kt, kh, kw]``) and the order diffusers' ``WanTransformer3DModel`` flattens its patch
grid in, so a linear layer over these vectors is that convolution, and samples of any size pack
into one row of tokens (NaViT's patch n' pack) without padding.

``positions`` holds each token's ``(f, h, w)`` grid index, for 3-D rotary embeddings; they
start at 0 in every sample, so a packed sample sees the positions it would see alone.
"""

from __future__ import annotations

from typing import Protocol

import torch


class VideoModelConfig(Protocol):
    """What data checks need of a video model's config."""

    patch_size: tuple[int, int, int]
    in_channels: int
    """Channels per latent position the model reads: the latent's, plus any conditioning channels."""
    out_channels: int
    """The latent's channels (what the model predicts)."""
    text_dim: int
    image_dim: int | None
    """Width of the image encoder states the model cross-attends to (None: no image branch)."""


def patch_grid(shape: tuple[int, ...] | torch.Size, patch: tuple[int, int, int]) -> tuple[int, int, int]:
    """The patch grid ``(F', H', W')`` of a latent of ``shape = [C, F, H, W]``; ValueError naming
    the shape and the patch size when the patch does not divide it."""
    if len(shape) != 4:
        raise ValueError(f"a latent must be [C, F, H, W]; got shape {list(shape)}")
    _, *sizes = shape
    if any(s % p for s, p in zip(sizes, patch)):
        raise ValueError(f"latent shape {list(shape)} (C, F, H, W): patch size {list(patch)} (t, h, w) does not "
                         f"divide its (F, H, W) = {sizes}; crop or resize the sample, or pick a patch size "
                         "that divides every latent's frames, height and width")
    return tuple(s // p for s, p in zip(sizes, patch))


def patchify(latent: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """``[C, F, H, W]`` -> ``[F'·H'·W', C·pt·ph·pw]`` (module docstring order)."""
    f, h, w = patch_grid(latent.shape, patch)
    c = latent.shape[0]
    pt, ph, pw = patch
    x = latent.reshape(c, f, pt, h, ph, w, pw)
    return x.permute(1, 3, 5, 0, 2, 4, 6).reshape(f * h * w, c * pt * ph * pw)


def unpatchify(tokens: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """``[F'·H'·W', C·pt·ph·pw]`` -> ``[C, F, H, W]``: the inverse of ``patchify``."""
    f, h, w = grid
    pt, ph, pw = patch
    c = tokens.shape[1] // (pt * ph * pw)
    x = tokens.reshape(f, h, w, c, pt, ph, pw)
    return x.permute(3, 0, 4, 1, 5, 2, 6).reshape(c, f * pt, h * ph, w * pw)


def grid_positions(grid: tuple[int, int, int], device: torch.device | None = None) -> torch.Tensor:
    """``[F'·H'·W', 3]`` int64 ``(f, h, w)`` index of each token of one sample, raster order."""
    axes = [torch.arange(n, device=device) for n in grid]
    return torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
