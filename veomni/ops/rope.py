"""Rotary position embeddings: rotate-half (HF Llama/Qwen, 1-D, Qwen2-VL's 2-D vision RoPE and its
multimodal M-RoPE), and Wan's 3-D interleaved RoPE over (frame, height, width) patch positions for
video diffusion.

Frequencies are recomputed from ``(head_dim, theta, scaling)`` on every call instead of being
kept in a buffer: it costs ``head_dim / 2`` elements, and a model built on the meta device and
materialised later has no buffer to forget to re-initialise.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling: dict | None) -> None:
    """Raise ``ValueError`` unless ``scaling`` is None or a complete, supported HF rope dict."""
    if scaling is None:
        return
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in scaling]
        if missing:
            raise ValueError(f"rope_scaling of type 'llama3' is missing keys {missing}")


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with HF's "llama3" smoothing when asked."""
    check_rope_scaling(scaling)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type != "llama3":
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_ctx / high) & ~(wavelen > old_ctx / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape [*position_ids.shape, head_dim], computed in fp32, cast to ``dtype``."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_cos_sin(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, section: tuple[int, ...] | list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL): ``cos, sin`` [T, head_dim] from (t, h, w) positions [T, 3].

    The ``head_dim // 2`` frequency slots are cut into consecutive blocks of ``section`` sizes
    (``mrope_section``, summing to ``head_dim // 2``); block ``j`` turns with axis ``j % 3``'s
    position, then the halves are duplicated for rotate-half as in ``rope_cos_sin`` (transformers'
    ``Qwen2VLRotaryEmbedding``). A text token has t = h = w, so it rotates as plain 1-D RoPE.
    """
    if position_ids.ndim != 2 or position_ids.shape[1] != 3:
        raise ValueError(f"M-RoPE takes position_ids [T, 3] (t, h, w), got {tuple(position_ids.shape)}")
    if sum(section) != inv_freq.shape[0]:
        raise ValueError(f"mrope_section {list(section)} must sum to head_dim // 2 = {inv_freq.shape[0]}")
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)  # [T, 3, head_dim // 2]
    blocks = freqs.split(list(section), dim=-1)
    freqs = torch.cat([block[:, j % 3] for j, block in enumerate(blocks)], dim=-1)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_2d_cos_sin(
    positions_hw: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Axial 2D RoPE for image patches: ``cos, sin`` [N, head_dim] from (row, col) ``positions_hw`` [N, 2].

    Each rotated pair of dims turns with either the row or the column: the first quarter of
    the frequency slots uses rows, the second quarter columns, both with the ``head_dim // 2``
    frequencies of ``rope_inv_freq``; then the halves are duplicated for rotate-half, as in
    ``rope_cos_sin``. So ``q . k`` depends only on the (row, col) offset between two patches.
    This is the layout of Qwen2-VL's vision tower. ``head_dim`` must be a multiple of 4.
    """
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs head_dim divisible by 4 (a rotated pair per axis), got {head_dim}")
    inv_freq = rope_inv_freq(head_dim // 2, theta, device=positions_hw.device)
    freqs = (positions_hw[..., None].float() * inv_freq).flatten(-2)  # [N, 2 * head_dim / 4]: rows, then cols
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate packed ``q`` [T, Hq, D] and ``k`` [T, Hkv, D] by per-token ``cos/sin`` [T, D]."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def wan_rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """How Wan splits a head's dims between the (f, h, w) axes: ``2 * (head_dim // 6)`` each for
    height and width, the rest for frames (diffusers' ``WanRotaryPosEmbed``)."""
    if head_dim % 2 or head_dim < 6:
        raise ValueError(f"3D RoPE needs an even head_dim >= 6 (rotated pairs on three axes), got {head_dim}")
    spatial = 2 * (head_dim // 6)
    return head_dim - 2 * spatial, spatial, spatial


def rope_3d_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wan's 3D RoPE: ``cos, sin`` [T, head_dim // 2] (one angle per rotated pair) from (f, h, w)
    ``positions`` [T, 3].

    Each axis gets its own block of pairs (``wan_rope_axis_dims``) with the frequencies
    ``theta ** (-2j / axis_dims)`` of a 1-D RoPE over that many dims; angles are computed in
    float64 and cast to float32, as diffusers does, so imported Wan weights see the same rotation.
    Computed per call from the positions alone: a row sliced by sequence parallelism rotates
    each of its tokens exactly as the whole row would.
    """
    angles = []
    for axis, dims in enumerate(wan_rope_axis_dims(head_dim)):
        inv_freq = 1.0 / theta ** (torch.arange(0, dims, 2, dtype=torch.float64, device=positions.device) / dims)
        angles.append(positions[:, axis, None].double() * inv_freq)
    angle = torch.cat(angles, dim=-1)
    return angle.cos().float(), angle.sin().float()


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of adjacent dims ``(2j, 2j+1)`` of ``x`` [T, H, D] by per-token angles
    ``cos/sin`` [T, D // 2] (the interleaved convention of Wan, Flux and CogVideoX, not
    rotate-half); computed in the angles' precision, returned in ``x``'s dtype."""
    cos, sin = cos[:, None], sin[:, None]
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).to(x.dtype)
