"""Validation samples during training: a contact sheet of a few held-out captions every so often.

The engine calls the writer built here as ``writer(model, step, out_dir, write)`` on every rank
with the same inputs, so sharded forwards stay matched across ranks; only the call with
``write=True`` writes files. The captions, their clip sizes and the seed are fixed when the
writer is built, so successive sheets show the same prompts from the same noise: the change
between them is training. The VAE and the text encoder (named by the latent manifest) load on
the first call, on the model's device.

A conditioning-channel model (Wan2.1 image-to-video, ``in_channels`` > ``out_channels``) samples
each held-out caption from its clip's first frame: the ``condition`` (and, with ``image_dim``,
``image``) tensors the held-out latent cache stores for that clip (the launch check has matched
the cache's manifest to the model), so no image encoder loads.
"""

from __future__ import annotations

import dataclasses
import json
import tarfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load
from torch import nn

from models.dit.image_to_video import ConditionInputs, is_conditioned
from models.dit.media import write_contact_sheet
from models.dit.sample import SampleSettings
from models.dit.task import diffusion_task
from models.dit.text_to_video import VideoPipeline
from veomni.contract import SampleWriter
from veomni.tasks.flow import DiffusionTask

DEFAULT_SETTINGS = SampleSettings(steps=20)


@dataclass(frozen=True)
class HeldOutPrompt:
    caption: str
    frames: int
    height: int
    width: int
    condition: torch.Tensor | None = None
    """[Q, F', H', W'] of a conditioning-channel model: the clip's first-frame channels from the cache."""
    image: torch.Tensor | None = None
    """[L, image_dim]: the clip's first-frame image states from the cache."""


def held_out_prompts(split: str | Path, count: int, model_config: Any = None) -> list[HeldOutPrompt]:
    """The first ``count`` distinct captions of a split's shards, each with its clip's size (and, for a
    conditioning-channel ``model_config``, its clip's conditioning tensors, read only for the captions kept)."""
    conditioned = model_config is not None and is_conditioned(model_config)
    shards = sorted(Path(split).glob("*.tar"))
    if not shards:
        raise FileNotFoundError(f"no .tar shards in {split}: validation samples need the held-out latent split")
    prompts: dict[str, HeldOutPrompt] = {}
    for shard in shards:
        with tarfile.open(shard) as tar:
            for member in tar:
                if not member.name.endswith(".json"):
                    continue
                meta = json.loads(tar.extractfile(member).read())
                if meta["caption"] in prompts:
                    continue
                prompt = HeldOutPrompt(meta["caption"], int(meta["frames"]), int(meta["height"]), int(meta["width"]))
                if conditioned:
                    prompt = _with_conditioning(prompt, tar, member.name.removesuffix(".json"),
                                                model_config.image_dim is not None)
                prompts[meta["caption"]] = prompt
                if len(prompts) == count:
                    return list(prompts.values())
    return list(prompts.values())


def _with_conditioning(prompt: HeldOutPrompt, tar: tarfile.TarFile, key: str, image: bool) -> HeldOutPrompt:
    """``prompt`` with the ``condition`` (and ``image``) tensors of sample ``key``; ValueError naming the
    sample when it lacks them."""
    member = f"{key}.latent.safetensors"
    tensors = load(tar.extractfile(member).read()) if member in tar.getnames() else {}
    missing = [name for name in ("condition", "image")[:1 + image] if name not in tensors]
    if missing:
        raise ValueError(f"held-out sample {key!r} of {tar.name} has no {' or '.join(missing)} tensor: the model reads "
                         "first-frame conditioning; rebuild the latents with data/build_video_latents.py --condition"
                         + (" --image-encoder FOLDER" if image else ""))
    return dataclasses.replace(prompt, condition=tensors["condition"].float(),
                               image=tensors["image"].float() if image else None)


def _conditions(prompts: list[HeldOutPrompt]) -> ConditionInputs | None:
    """The stacked conditioning tensors of ``prompts`` (clips of one size), None for a text-to-video model."""
    if prompts[0].condition is None:
        return None
    image = None if prompts[0].image is None else torch.stack([p.image for p in prompts])
    return ConditionInputs(torch.stack([p.condition for p in prompts]), image)


def validation_writer(model_config: Any, data_config: Any, count: int = 4,
                      settings: SampleSettings = DEFAULT_SETTINGS, task: DiffusionTask | None = None) -> SampleWriter:
    """The engine's validation-sample hook for a DiT (module docstring); ``data_config.train_path`` is
    the latent split naming the VAE and text encoder, ``eval_path`` (else train) gives the captions
    (and a conditioning-channel model's first frames). ``task`` defaults to the one the config's
    registered family trains with."""
    prompts = held_out_prompts(data_config.eval_path or data_config.train_path, count, model_config)
    task = task or diffusion_task(model_config)
    loaded: list[VideoPipeline] = []

    def write_validation_samples(model: nn.Module, step: int, out_dir: Path, write: bool) -> dict[str, Path]:
        device = next(model.parameters()).device
        if not loaded:
            loaded.append(VideoPipeline.from_latent_manifest(model, task, model_config.patch_size,
                                                             data_config.train_path, device))
        pipeline = loaded[0]
        pipeline.model = model
        by_size: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for i, prompt in enumerate(prompts):
            by_size[(prompt.frames, prompt.height, prompt.width)].append(i)
        clips: list[np.ndarray | None] = [None] * len(prompts)
        for (frames, height, width), members in by_size.items():
            generated = pipeline.generate([prompts[i].caption for i in members], frames, height, width,
                                          settings.steps, settings.guidance, settings.seed,
                                          conditions=_conditions([prompts[i] for i in members]))
            for i, clip in zip(members, generated):
                clips[i] = clip
        if not write:
            return {}
        sheet = write_contact_sheet(clips, [p.caption for p in prompts], out_dir / f"samples_step_{step:08d}.png")
        return {"contact_sheet": sheet}

    return write_validation_samples
