"""The latent split's manifest as sampling reads it: the folders it names (VAE, text encoder,
image encoder), resolved wherever the cache was moved with its inputs.

Why its own module: the text-to-video pipeline and the image-to-video conditioning both read
folders from it, and neither should import the other for that."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_latent_manifest(train_path: str | Path) -> tuple[dict[str, Any], Path]:
    """The latent split's ``manifest.json`` and its folder; FileNotFoundError naming the fix."""
    folder = Path(train_path)
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest} not found: data.train_path must be a latent split built by "
                                "data/build_video_latents.py (it names the VAE and the text encoder)")
    return json.loads(manifest.read_text()), folder


def resolve_folder(path: str, manifest_folder: Path, fix: str = "rebuild the latents") -> Path:
    """A folder named in a manifest: absolute, or relative to the manifest's folder or the working directory."""
    candidates = [Path(path)] if Path(path).is_absolute() else [manifest_folder / path, Path.cwd() / path]
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"folder {path!r} named in the latent manifest of {manifest_folder} not found "
                            f"(looked at {', '.join(str(c) for c in candidates)}); {fix}")
