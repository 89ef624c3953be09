"""Writing sampled clips for people to look at: one GIF per clip and a captioned contact sheet.

Pillow only (always installed with the zoo). Clips are tiny (32-48 pixels), so both are enlarged
by an integer factor with nearest-neighbour resampling: pixels stay what the model produced.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

LABEL_HEIGHT = 14
GAP = 4
BACKGROUND = (255, 255, 255)


def _check_clip(clip: np.ndarray) -> None:
    if clip.dtype != np.uint8 or clip.ndim != 4 or clip.shape[-1] != 3:
        raise ValueError(f"a clip must be uint8 [F, H, W, 3]; got {clip.dtype} {list(clip.shape)}")


def _enlarge(frame: np.ndarray, scale: int) -> Image.Image:
    image = Image.fromarray(frame)
    return image.resize((image.width * scale, image.height * scale), Image.NEAREST) if scale > 1 else image


def write_gif(clip: np.ndarray, path: Path, fps: float = 4.0, scale: int = 4) -> Path:
    """``clip`` uint8 [F, H, W, 3] -> an endlessly looping GIF at ``path``."""
    _check_clip(clip)
    frames = [_enlarge(frame, scale) for frame in clip]
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
    return path


def write_contact_sheet(clips: list[np.ndarray], captions: list[str], path: Path, scale: int = 2) -> Path:
    """One row per clip (its caption above its frames, left to right) in a PNG at ``path``."""
    if len(clips) != len(captions) or not clips:
        raise ValueError(f"a contact sheet needs one caption per clip; got {len(clips)} clips, "
                         f"{len(captions)} captions")
    for clip in clips:
        _check_clip(clip)
    cell_h = max(c.shape[1] for c in clips) * scale
    cell_w = max(c.shape[2] for c in clips) * scale
    font = ImageFont.load_default()
    text_w = max(int(ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength(c, font=font)) for c in captions)
    width = GAP + max(text_w, max(c.shape[0] for c in clips) * (cell_w + GAP))
    row_h = LABEL_HEIGHT + cell_h + GAP
    sheet = Image.new("RGB", (width, GAP + row_h * len(clips)), BACKGROUND)
    draw = ImageDraw.Draw(sheet)
    for row, (clip, caption) in enumerate(zip(clips, captions)):
        top = GAP + row * row_h
        draw.text((GAP, top), caption, fill=(0, 0, 0), font=font)
        for column, frame in enumerate(clip):
            sheet.paste(_enlarge(frame, scale), (GAP + column * (cell_w + GAP), top + LABEL_HEIGHT))
    path.parent.mkdir(parents=True, exist_ok=True)
    sheet.save(path)
    return path
