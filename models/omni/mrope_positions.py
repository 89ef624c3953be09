"""The (t, h, w) positions of Qwen2-VL / Qwen2.5-VL's multimodal RoPE for a packed row.

Pure function of the row's token types and its media grids: what transformers' ``get_rope_index``
computes for one sample, here for every sample of a packed row (positions restart at each
``cu_seqlens`` boundary, media grids are consumed in row order across samples). Text tokens count
on from the last position on all three axes; the ``t * h/m * w/m`` tokens of an image or video
take ``start + (time index, row, column)`` of their merged grid, and the text after them goes on
from ``start + max(h/m, w/m)``. A video's time index is its temporal patch index times
``tokens_per_second * second_per_grid_ts`` (Qwen2.5-VL; truncated to an integer as transformers
does), or the patch index itself (Qwen2-VL: ``tokens_per_second=None``).

The result is [T, 3], row-major, so the engine's sequence parallelism slices it with the row.
"""

from __future__ import annotations

import torch

TEXT, IMAGE, VIDEO = 0, 1, 2


def token_types(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """0 for text, 1 for image and 2 for video placeholder tokens (transformers' ``mm_token_type_ids``)."""
    return (input_ids == image_token_id).long() * IMAGE + (input_ids == video_token_id).long() * VIDEO


def _media_positions(start: int, grid: list[int], merge_size: int, time_step) -> torch.Tensor:
    t, h, w = grid[0], grid[1] // merge_size, grid[2] // merge_size
    times = (torch.arange(t) * time_step).long() + start
    rows, cols = torch.arange(h) + start, torch.arange(w) + start
    tt, hh, ww = torch.meshgrid(times, rows, cols, indexing="ij")
    return torch.stack([tt.flatten(), hh.flatten(), ww.flatten()], dim=-1)


def mrope_position_ids(
    types: torch.Tensor,
    cu_seqlens: torch.Tensor,
    merge_size: int,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    tokens_per_second: float | None = None,
) -> torch.Tensor:
    """Positions [T, 3] of a packed row whose token ``types`` [T] are ``token_types``'s.

    ``image_grid_thw`` / ``video_grid_thw`` [n, 3] (in patches, temporal patches for t) list the
    row's images and videos in row order; ``second_per_grid_ts`` [n_videos] the seconds one
    temporal patch of each video spans (None: 1.0 each). ValueError when the placeholders do not
    fit the grids.
    """
    grids = {IMAGE: _rows(image_grid_thw), VIDEO: _rows(video_grid_thw)}
    used = {IMAGE: 0, VIDEO: 0}
    seconds = None if second_per_grid_ts is None else torch.as_tensor(second_per_grid_ts)
    types_list = types.tolist()
    out = torch.empty(len(types_list), 3, dtype=torch.long)
    bounds = cu_seqlens.tolist()
    for begin, end in zip(bounds[:-1], bounds[1:]):
        pos, i = 0, begin
        while i < end:
            kind = types_list[i]
            if kind == TEXT:
                j = i
                while j < end and types_list[j] == TEXT:
                    j += 1
                out[i:j] = (torch.arange(j - i) + pos)[:, None]
                pos, i = pos + j - i, j
                continue
            grid = _next_grid(grids, used, kind)
            step = 1
            if kind == VIDEO and tokens_per_second is not None:
                step = tokens_per_second * (seconds[used[VIDEO] - 1] if seconds is not None else 1)
            media = _media_positions(pos, grid, merge_size, step)
            if i + media.shape[0] > end or any(t != kind for t in types_list[i:i + media.shape[0]]):
                raise ValueError(f"the {_NAMES[kind]} with grid_thw {grid} needs {media.shape[0]} consecutive "
                                 f"placeholder tokens at row position {i}, in one sample")
            out[i:i + media.shape[0]] = media
            pos, i = pos + max(grid[1], grid[2]) // merge_size, i + media.shape[0]
    for kind, rows in grids.items():
        if used[kind] != len(rows):
            raise ValueError(f"{len(rows)} {_NAMES[kind]} grids given but the row holds {used[kind]} of them")
    return out.to(types.device)


_NAMES = {IMAGE: "image", VIDEO: "video"}


def _rows(grid_thw: torch.Tensor | None) -> list[list[int]]:
    return [] if grid_thw is None else torch.as_tensor(grid_thw).tolist()


def _next_grid(grids: dict[int, list[list[int]]], used: dict[int, int], kind: int) -> list[int]:
    if used[kind] == len(grids[kind]):
        raise ValueError(f"the row has more {_NAMES[kind]} placeholders than the {len(grids[kind])} "
                         f"{_NAMES[kind]} grids given")
    used[kind] += 1
    return grids[kind][used[kind] - 1]
