"""Validation samples during training: a contact sheet of a few held-out captions every so often.

The engine calls the writer built here as ``writer(model, step, out_dir, write)`` on every rank
with the same inputs, so sharded forwards stay matched across ranks; only the call with
``write=True`` writes files. The captions, their clip sizes and the seed are fixed when the
writer is built, so successive sheets show the same prompts from the same noise: the change
between them is training. The VAE and the text encoder (named by the latent manifest) load on
the first call, on the model's device.
"""

from __future__ import annotations

import json
import tarfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

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


def held_out_prompts(split: str | Path, count: int) -> list[HeldOutPrompt]:
    """The first ``count`` distinct captions of a split's shards, each with its clip's size."""
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
                prompts.setdefault(meta["caption"], HeldOutPrompt(meta["caption"], int(meta["frames"]),
                                                                  int(meta["height"]), int(meta["width"])))
                if len(prompts) == count:
                    return list(prompts.values())
    return list(prompts.values())


def validation_writer(model_config: Any, data_config: Any, count: int = 4,
                      settings: SampleSettings = DEFAULT_SETTINGS, task: DiffusionTask | None = None) -> SampleWriter:
    """The engine's validation-sample hook for a DiT (module docstring); ``data_config.train_path`` is
    the latent split naming the VAE and text encoder, ``eval_path`` (else train) gives the captions.
    ``task`` defaults to the one the config's registered family trains with."""
    prompts = held_out_prompts(data_config.eval_path or data_config.train_path, count)
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
                                          settings.steps, settings.guidance, settings.seed)
            for i, clip in zip(members, generated):
                clips[i] = clip
        if not write:
            return {}
        sheet = write_contact_sheet(clips, [p.caption for p in prompts], out_dir / f"samples_step_{step:08d}.png")
        return {"contact_sheet": sheet}

    return write_validation_samples
