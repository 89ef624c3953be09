"""The ``frames`` dataset kind: random frames of raw video clips, as fixed-size images (VAE training).

Reads webdataset shards of clips: each sample has ``frames.npy`` (uint8 numpy [F, H, W, 3]) and a
``json`` member (unused here). Every clip the consumer keeps gives one image: a frame and a
``crop`` x ``crop`` window of it, both drawn from a generator seeded by (seed, epoch, record
index), then scaled to [-1, 1] as [3, crop, crop]. Fixed-size crops let images of any clip size
stack into one batch; ``crop`` is the model config's ``sample_size`` (the training resolution
diffusers' ``AutoencoderKL`` records). ``data.tokens_per_micro_batch`` images make one
micro-batch ``{"images": [B, 3, crop, crop]}`` (the reconstruction task's contract).

Consumers (data-parallel ranks x loader workers) split records as the text loader does: every
consumer reads the same per-epoch stream (shard order shuffled by seed and epoch for training,
sorted for eval) and consumer ``c`` of ``C`` keeps record ``i`` when ``i % C == c``, so ranks
never share a clip. Training loops over epochs (a new frame and crop of each clip every epoch);
eval is one pass.

Resume is exact: the state is the position (epoch, record index) of the first image not yet
yielded (``ResumableDataset``'s default position, ``veomni/data/resume.py``), and the frame and
crop of a record depend only on that position. At another layout every consumer starts at the
earliest old position: every clip before it was used. A clip whose frames
do not decode, have the wrong dtype or shape, or are smaller than the crop is skipped and counted
(``skipped``) like a damaged shard; the run stops only past ``data.max_bad_fraction``.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from veomni.config.schema import DataConfig
from veomni.data.kinds import DatasetKind, DatasetRequest, ResumableDataset, register_dataset
from veomni.data.packing import greedy_pack
from veomni.data.sources import ReadStats, count_bad, iter_tar_samples, manifest_shard_records, resolve_files
from veomni.data.video.clip_format import CorruptClipError, decode_clip
from veomni.errors import BadConfig, BadData

logger = logging.getLogger(__name__)

STATE_FORMAT = "veomni.frames.v1"


def crop_image(frames: np.ndarray, crop: int, rng: random.Random) -> torch.Tensor:
    """One random frame's random ``crop`` x ``crop`` window as float [3, crop, crop] in [-1, 1]."""
    count, height, width, _ = frames.shape
    if height < crop or width < crop:
        raise BadData(f"frames of {height}x{width} are smaller than the {crop}x{crop} crop")
    index, top, left = rng.randrange(count), rng.randrange(height - crop + 1), rng.randrange(width - crop + 1)
    window = np.ascontiguousarray(frames[index, top:top + crop, left:left + crop])
    return torch.from_numpy(window).permute(2, 0, 1).float() / 127.5 - 1


class FramesDataset(ResumableDataset):
    state_format = STATE_FORMAT

    def __init__(self, request: DatasetRequest) -> None:
        super().__init__(request.dp_rank, request.dp_size)
        problems = check_frames_data(request.cfg, request.model_config)
        if problems:
            raise BadConfig("; ".join(problems))
        _, self.files = resolve_files(request.path, "webdataset")
        self.shard_records = manifest_shard_records(request.path)
        """Records per shard file, from the manifest: what a damaged shard lost (``veomni.data.sources``)."""
        self.cfg = request.cfg
        self.crop = request.model_config.sample_size
        self.train = request.split == "train"
        self.seed = request.seed
        self.skipped = 0
        """Clips skipped as corrupt so far by this dataset's iterations (counted once per epoch)."""

    def _epoch_files(self, epoch: int) -> list[Path]:
        files = list(self.files)
        if self.train and self.cfg.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(files)
        return files

    def _images(self, start: tuple[int, int]) -> Iterator[tuple[torch.Tensor, tuple[int, int]]]:
        """This consumer's images from ``start`` on, each tagged with its own position."""
        consumer, consumers = self.consumer()
        epoch, first = start
        while self.train or epoch == 0:
            stats = ReadStats()
            produced = False
            records = iter_tar_samples(self._epoch_files(epoch), self.cfg.max_bad_fraction, stats,
                                       warn=consumer == 0, shard_records=self.shard_records)
            for index, record in enumerate(records):
                if index < first or index % consumers != consumer:
                    continue
                image = self._image(record, epoch, index, stats)
                if image is not None:
                    produced = True
                    yield image, (epoch, index)
            self.skipped += stats.bad
            if self.train and first == 0 and not produced:
                raise BadData(f"consumer {consumer} of {consumers} got no usable clip in a whole epoch of "
                              f"{self.files[0].parent}: fewer clips than dp ranks x workers, or all corrupt")
            epoch, first = epoch + 1, 0

    def _image(self, record: dict, epoch: int, index: int, stats: ReadStats) -> torch.Tensor | None:
        url = record.get("__url__", "?")
        try:
            frames = decode_clip(record).frames
        except CorruptClipError as error:
            logger.warning("%s: clip %s skipped (%s: %s)", url, record.get("__key__"), type(error).__name__, error)
            count_bad(stats, url, self.cfg.max_bad_fraction)
            return None
        return crop_image(frames, self.crop, random.Random(f"{self.seed}:{epoch}:{index}"))

    def __iter__(self) -> Iterator[dict]:
        return self._batches(self.begin())

    def _batches(self, start: tuple[int, int]) -> Iterator[dict]:
        for images, next_position in greedy_pack(self._images(start), self.cfg.tokens_per_micro_batch,
                                                 cost=lambda image: 1):
            self._pos = next_position if next_position is not None else (1, 0)  # eval: after its one pass
            yield {"images": torch.stack(images)}


def check_frames_data(cfg: DataConfig, model_config: Any) -> list[str]:
    """Before any worker starts: the model names a crop size, and a micro-batch holds images."""
    problems = []
    crop = getattr(model_config, "sample_size", None)
    if not isinstance(crop, int) or crop <= 0:
        problems.append(f"the frames kind crops images to the model's sample_size; {type(model_config).__name__} "
                        f"has {crop!r}")
    if cfg.tokens_per_micro_batch <= 0:
        problems.append(f"data.tokens_per_micro_batch={cfg.tokens_per_micro_batch}: the frames kind takes it as "
                        "images per micro-batch, so it must be >= 1")
    return problems


register_dataset(DatasetKind("frames", build=FramesDataset, needs_tokenizer=False, check=check_frames_data))
