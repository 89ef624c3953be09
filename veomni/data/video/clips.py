"""The ``video_clips`` dataset kind: raw captioned clips encoded on the fly by the frozen VAE and
text encoder, packed exactly like precomputed latents.

Why a second mode: precomputing (``data/build_video_latents.py`` -> ``video_latents``) is the
default and what a GPU cluster should do, since it takes the frozen encoders out of the training
loop; encoding in the loader skips the precompute step and its disk copy (a new VAE or caption
set is one flag away). The models run under ``torch.no_grad`` on CPU, in each loader consumer
(``data.num_workers`` spreads the cost), through the same code as the precompute
(``veomni.data.video.encoders``), so both modes give the same packed batches.

Everything else is ``video_latents``' (``VideoLatentsDataset``, subclassed): shard order, the
data-parallel and worker split, packing, exact resume, and corrupt records: a clip that does not
decode (``veomni.data.video.clip_format.decode_clip``) is skipped and counted under
``data.max_bad_fraction``. Every record read is decoded, but only the consumer's own records are
encoded (a resumed reader re-encodes only the packer's buffered ones). A clip the VAE cannot
encode, or a caption the tokenizer cannot read, stops the run naming it (the launch check
should have said so).

**Launch check** (``check_video_clips``): ``data.vae`` and ``data.text_encoder`` are set and hold
a VAE and an encoder (their ``config.json`` only: nothing is loaded), and each split's clip
manifest (``"shapes": {"FxHxW": count}``) becomes latent shapes by the VAE's factors, checked like
``video_latents``' manifests: channels, text width, divisibility by the patch size, the budget.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from veomni.config.schema import DataConfig
from veomni.data.builders import MANIFEST
from veomni.data.kinds import DatasetKind, register_dataset
from veomni.data.video.clip_format import Clip, decode_clip
from veomni.data.video.clip_packing import LatentSample
from veomni.data.video.conditioning import conditioning_problems
from veomni.data.video.encoders import (
    EncoderError,
    LatentEncoder,
    TextEncoder,
    VaeGeometry,
    load_text_encoder,
    load_vae,
    read_vae_geometry,
    text_encoder_width,
)
from veomni.data.video.latents import VideoLatentsDataset, each_split_problems, latent_problems, model_problems

KIND = "video_clips"
ENCODER_KEYS = {"vae": "a diffusers VAE folder (e.g. data/cache/video/vae)",
                "text_encoder": "a transformers text-encoder folder with its tokenizer "
                                "(e.g. data/cache/video/text_encoder)"}


class VideoClipsDataset(VideoLatentsDataset):
    """One consumer's packed rows of a raw clip split, encoded as they are read (module docstring)."""

    @staticmethod
    def _split_problems(name: str, path: str, cfg: DataConfig, model_config: Any) -> list[str]:
        return encoder_problems(cfg) or clip_split_problems(name, path, cfg, model_config)

    @cached_property
    def _encoders(self) -> tuple[LatentEncoder, TextEncoder]:
        """Loaded on first use, so each loader worker loads its own."""
        return load_vae(Path(self.cfg.vae)), load_text_encoder(Path(self.cfg.text_encoder))

    def _decode_record(self, record: dict) -> Clip:
        return decode_clip(record)

    def _to_sample(self, clip: Clip) -> LatentSample:
        vae, text = self._encoders
        shape = vae.check(clip)
        (latent,) = vae.encode([clip], batch_frames=clip.frames.shape[0])
        (states,) = text.encode([clip.meta["caption"]])
        return LatentSample(clip.key, latent, states, {**clip.meta, "latent_shape": shape})


def encoder_problems(cfg: DataConfig) -> list[str]:
    """``data.vae`` and ``data.text_encoder`` unset, or not holding what they should."""
    problems = [f"data.{key} is not set: the {KIND} kind encodes clips on the fly and needs {what}"
                for key, what in ENCODER_KEYS.items() if not getattr(cfg, key)]
    if problems:
        return problems
    for key, read in (("vae", read_vae_geometry), ("text_encoder", text_encoder_width)):
        try:
            read(Path(getattr(cfg, key)))
        except EncoderError as error:
            problems.append(f"data.{key}: {error}")
    return problems


def clip_split_problems(name: str, path: str, cfg: DataConfig, model_config: Any) -> list[str]:
    """One clip split's manifest, through the VAE's geometry, against the model and budget."""
    if cfg.format == "jsonl":
        return [f"data.format jsonl: the {KIND} kind reads webdataset shards; set data.format: webdataset"]
    file = Path(path) / MANIFEST
    try:
        shapes = json.loads(file.read_text())["shapes"]
    except (OSError, ValueError, KeyError) as error:
        return [f"{name}: {file} lists no clip shapes ({type(error).__name__}: {error}); the {KIND} kind needs the "
                "manifest a clip builder writes (data/build_moving_shapes.py)"]
    geometry = read_vae_geometry(Path(cfg.vae))
    examples, problems = latent_examples(shapes, geometry)
    source = f"{path} (encoded by the VAE at {cfg.vae}, text by the encoder at {cfg.text_encoder})"
    problems = [f"{name}: {path}: {problem} (the VAE at {cfg.vae})" for problem in problems]
    text_dim = text_encoder_width(Path(cfg.text_encoder))
    example = next(iter(examples.values()), "no sample")
    # the loader encodes latents and captions only: conditioning is the precompute's (empty manifest)
    return (problems + latent_problems(name, source, geometry.latent_channels, text_dim, examples, cfg, model_config)
            + conditioning_problems(name, source, {}, example, model_config))


def latent_examples(shapes: dict[str, int], geometry: VaeGeometry) -> tuple[dict[str, str], list[str]]:
    """(latent shape ``"CxFxHxW"`` -> which clips give it, problems of clips the VAE cannot encode)."""
    examples: dict[str, str] = {}
    problems = []
    for text in shapes:
        frames, height, width = (int(size) for size in text.split("x"))
        try:
            latent = geometry.latent_shape(frames, height, width)
        except EncoderError as error:
            problems.append(str(error))
            continue
        examples.setdefault("x".join(map(str, latent)), f"clips of {text} (FxHxW)")
    return examples, problems


def check_video_clips(cfg: DataConfig, model_config: Any) -> list[str]:
    """The launcher's pre-flight: the encoders' configs and each split's clip manifest against the
    model (no shard is opened, no model loaded)."""
    return (model_problems(model_config, KIND) or encoder_problems(cfg)
            or each_split_problems(cfg, model_config, clip_split_problems))


register_dataset(DatasetKind(KIND, VideoClipsDataset, check=check_video_clips))
