"""Raw clip shards in the format of ``data/cache/video/moving_shapes`` (docs: the video brief), for
tests: webdataset tars whose samples hold ``frames.npy`` (uint8 [F, H, W, 3]) and ``json``.

Each clip is one flat-colour square or disc moving over a flat background, with F in {1, 5, 9}
and H, W in {32, 48}; ``corrupt`` extra samples carry bytes that are not a numpy array.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (50, 70, 230), "yellow": (230, 210, 40)}


def make_clip(rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    frames = int(rng.choice([1, 5, 9]))
    height, width = (int(v) for v in rng.choice([32, 48], size=2))
    colour = str(rng.choice(list(COLOURS)))
    shape = str(rng.choice(["square", "circle"]))
    size = int(rng.integers(6, 14))
    y, x = rng.integers(0, height - size), rng.integers(0, width - size)
    dy, dx = rng.integers(-2, 3, size=2)
    clip = np.empty((frames, height, width, 3), dtype=np.uint8)
    clip[:] = rng.integers(0, 60, size=3, dtype=np.uint8)
    rows, cols = np.mgrid[:height, :width]
    for f in range(frames):
        top, left = np.clip(y + f * dy, 0, height - size), np.clip(x + f * dx, 0, width - size)
        if shape == "square":
            mask = (rows >= top) & (rows < top + size) & (cols >= left) & (cols < left + size)
        else:
            centre = (top + size / 2, left + size / 2)
            mask = (rows - centre[0]) ** 2 + (cols - centre[1]) ** 2 <= (size / 2) ** 2
        clip[f][mask] = COLOURS[colour]
    meta = {"caption": f"a {colour} {shape}", "colour": colour, "shape": shape, "size": "small",
            "direction": "still" if frames == 1 else "right", "speed": "still" if frames == 1 else "slow",
            "frames": frames, "height": height, "width": width}
    return clip, meta


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_clip_shards(folder: Path, clips: int, shards: int = 2, seed: int = 0, corrupt: int = 0) -> Path:
    """``clips`` good clips (and ``corrupt`` bad ones, spread over the shards) in ``shards`` tars."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    total = clips + corrupt
    bad = set(np.linspace(0, total - 1, corrupt).astype(int).tolist()) if corrupt else set()
    writers = [tarfile.open(folder / f"shard-{s:05d}.tar", "w") for s in range(shards)]
    for i in range(total):
        tar = writers[i % shards]
        key = f"clip{i:06d}"
        if i in bad:
            _add(tar, f"{key}.frames.npy", b"not a numpy array")
            _add(tar, f"{key}.json", b"{}")
            continue
        clip, meta = make_clip(rng)
        buffer = io.BytesIO()
        np.save(buffer, clip)
        _add(tar, f"{key}.frames.npy", buffer.getvalue())
        _add(tar, f"{key}.json", json.dumps(meta).encode())
    for tar in writers:
        tar.close()
    return folder
