"""Precompute the video DiT's training data: every clip's VAE latent and its caption's text states.

Why precompute: the VAE and the text encoder are frozen, so encoding each clip once (instead of
every step) takes them out of the training loop, and the DiT's data loader only packs tensors.

Input: a clip folder with ``train/`` and ``eval/`` splits (``data/build_moving_shapes.py``), a
diffusers VAE folder and a text-encoder folder (``data/build_text_encoder.py``; built here from
the train split's vocabulary when missing). The encoding itself (``AutoencoderKL`` per frame or
``AutoencoderKLWan`` per clip, the latent normalisation, the text states of the real tokens) is
``veomni/data/video/encoders.py``, shared with the ``video_clips`` dataset kind that encodes on
the fly; here clips of one size are batched, ``--batch-frames`` frames per VAE call. For Wan, the
manifest's ``shift_factor`` and ``scaling_factor`` are per-channel lists (``latents_mean`` and
``1 / latents_std``) that keep the formula ``(mean - shift) * scaling``.

Image-to-video (Wan2.1 I2V) data, computed once like the text states: ``--condition`` adds each
clip's ``condition`` [T + C, F', H', W'] (``models/dit/conditioning.py::first_frame_conditions``: a frame
mask of the VAE's temporal factor T channels, then the latent of the clip's first frame followed by
zero frames), and ``--image-encoder FOLDER`` (a transformers ``CLIPVisionModel`` saved with its
``CLIPImageProcessor``; nothing downloads) adds ``image`` [L, hidden_size], the encoder's
penultimate states of the first frame. The model that reads them has ``in_channels`` =
``2 C + T`` and ``image_dim`` = ``hidden_size`` (``veomni/data/video/conditioning.py`` checks it
at launch). The Wan2.2-style first-frame form (``model.first_frame_probability``) needs neither:
the clip's own latent frame 0 is its first frame's latent.

Output (per split, builder-standard: webdataset shards, then ``manifest.json``): samples of
``__key__``, ``latent.safetensors`` (``safetensors.torch.save`` of ``{"latent": float32
[C, F, H, W], "text": float32 [L, text_dim]}``, plus ``condition`` and ``image`` when asked) and
``json`` (the clip's json plus ``latent_shape``). The manifest records ``latent_channels``, ``text_dim``, ``shapes``
(``"CxFxHxW"`` -> count), ``example_keys`` (one key per shape), ``skipped_corrupt``, ``vae``
(``path``, ``class``, ``scaling_factor``, ``shift_factor``, ``spatial_factor``,
``temporal_factor``), ``text_encoder`` (``path``, ``max_length``), ``condition_channels`` (0 without),
``image_dim`` and ``image_encoder`` (``path``; null without) and ``inputs_sha256``: a hash
of the clips' manifests and the VAE's and encoder's files; a split is rebuilt when it differs
(a retrained VAE), else kept. A corrupt clip (``veomni.data.video.clip_format``) is skipped and
counted; more than ``--max-bad-fraction`` of a split is an error.

    python data/build_video_latents.py --clips data/cache/video/moving_shapes \\
        --vae data/cache/video/vae --text-encoder data/cache/video/text_encoder \\
        --out data/cache/video/moving_shapes_latents
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import webdataset
from safetensors.torch import save

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from build_text_encoder import build_text_encoder, caption_vocabulary  # noqa: E402

from models.dit.conditioning import first_frame_conditions  # noqa: E402
from veomni.data.builders import MANIFEST, publish_split, staging_folder  # noqa: E402
from veomni.data.sources import ReadStats, iter_tar_samples  # noqa: E402
from veomni.data.video import encoders as video_encoders  # noqa: E402
from veomni.data.video.clip_format import Clip, CorruptClipError, decode_clip  # noqa: E402
from veomni.data.video.encoders import (  # noqa: E402
    EncoderError,
    ImageEncoder,
    LatentEncoder,
    TextEncoder,
    load_image_encoder,
    load_vae,
)

FORMAT_VERSION = 2  # 2: shard_records (records per shard, what a damaged shard lost; publish_split writes it)
SAMPLES_PER_SHARD = 1000
CLIPS_PER_BUFFER = 64
PROGRESS_EVERY = 500


def load_text_encoder(path: Path, clips: Path) -> TextEncoder:
    """The encoder at ``path``: a transformers folder (its ``config.json``; a real umT5 folder has no
    ``manifest.json``) is read as it is; a missing or empty folder gets the tiny encoder built from
    the train split's vocabulary; any other folder is refused, never overwritten."""
    if not (path / MANIFEST).exists() and not (path / "config.json").exists():
        if path.is_dir() and any(path.iterdir()):
            raise EncoderError(f"--text-encoder {path}: no config.json, so not a transformers text-encoder folder "
                               "(save_pretrained of a UMT5EncoderModel and its tokenizer); name such a folder, or "
                               "a missing or empty one to build the tiny encoder there")
        build_text_encoder(path, caption_vocabulary(clips / "train"))
    return video_encoders.load_text_encoder(path)


@dataclass(frozen=True)
class Conditioning:
    """The image-to-video tensors asked for: ``condition`` (``--condition``) and ``image``
    (``--image-encoder``)."""

    condition: bool = False
    image_encoder: Path | None = None


def inputs_sha256(clips: Path, vae: Path, text_encoder: Path, conditioning: Conditioning = Conditioning()) -> str:
    """What the latents depend on: the clip manifests, every file of the VAE and encoder folders and
    the conditioning asked for."""
    digest = hashlib.sha256(b"condition" if conditioning.condition else b"")  # a text-to-video cache keeps its hash
    files = [clips / split / MANIFEST for split in ("train", "eval")]
    folders = (vae, text_encoder) + ((conditioning.image_encoder,) if conditioning.image_encoder else ())
    files += sorted(p for folder in folders for p in folder.iterdir() if p.is_file())
    for file in files:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()


def read_clips(split: Path, stats: ReadStats, skipped: list[str]) -> Iterator[Clip]:
    """The good clips of a split; corrupt ones are logged into ``skipped`` (damaged shards into ``stats``)."""
    for sample in iter_tar_samples(sorted(split.glob("*.tar")), 1.0, stats):
        try:
            yield decode_clip(sample)
        except CorruptClipError as error:
            skipped.append(str(error))


@dataclass
class Encoders:
    """The frozen encoders of one build; ``condition`` / ``image`` for image-to-video data."""

    vae: LatentEncoder
    text: TextEncoder
    condition: bool = False
    image: ImageEncoder | None = None


def encode_buffer(buffer: list[Clip], encoders: Encoders, batch_frames: int) -> list[tuple[Clip, dict]]:
    """(clip, tensors of its ``latent.safetensors``) for each clip of ``buffer``, in order."""
    vae = encoders.vae
    tensors: dict[str, dict[str, torch.Tensor]] = {clip.key: {} for clip in buffer}
    groups: dict[tuple, list[Clip]] = {}
    for clip in buffer:
        vae.check(clip)
        groups.setdefault(vae.batch_key(clip), []).append(clip)
    for group in groups.values():
        for clip, latent in zip(group, vae.encode(group, batch_frames)):
            tensors[clip.key]["latent"] = latent
        if encoders.condition:
            for clip, condition in zip(group, first_frame_conditions(vae, group, batch_frames)):
                tensors[clip.key]["condition"] = condition
    for clip, state in zip(buffer, encoders.text.encode([c.meta["caption"] for c in buffer])):
        tensors[clip.key]["text"] = state
    if encoders.image is not None:
        for clip, state in zip(buffer, encoders.image.encode([c.frames[0] for c in buffer])):
            tensors[clip.key]["image"] = state
    return [(clip, tensors[clip.key]) for clip in buffer]


def precompute_split(clips: Path, out: Path, encoders: Encoders, batch_frames: int, max_bad_fraction: float,
                     extra: dict) -> None:
    """Encode the split ``clips`` into ``out`` (staged; the staging folder is removed on failure)."""
    tmp = staging_folder(out)
    try:
        manifest = write_split(clips, tmp, encoders, batch_frames, max_bad_fraction)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    publish_split(tmp, out, {**manifest, **extra})
    print(f"{out}: {manifest['samples']} latents, shapes {manifest['shapes']}")


def write_split(clips: Path, tmp: Path, encoders: Encoders, batch_frames: int, max_bad_fraction: float) -> dict:
    """Write the latent shards of the split ``clips`` into ``tmp``; returns the manifest."""
    stats, skipped = ReadStats(), []
    shapes: Counter = Counter()
    example_keys: dict[str, str] = {}

    def write(writer: webdataset.ShardWriter, buffer: list[Clip]) -> None:
        for clip, tensors in encode_buffer(buffer, encoders, batch_frames):
            shape = list(tensors["latent"].shape)
            name = "x".join(map(str, shape))
            shapes[name] += 1
            example_keys.setdefault(name, clip.key)
            writer.write({"__key__": clip.key, "latent.safetensors": save(tensors),
                          "json": json.dumps({**clip.meta, "latent_shape": shape}).encode()})
        done = sum(shapes.values())
        if done // PROGRESS_EVERY != (done - len(buffer)) // PROGRESS_EVERY:
            print(f"{clips}: {done} clips encoded", flush=True)

    with webdataset.ShardWriter(str(tmp / "shard-%06d.tar"), maxcount=SAMPLES_PER_SHARD, verbose=0) as writer:
        buffer: list[Clip] = []
        for clip in read_clips(clips, stats, skipped):
            buffer.append(clip)
            if len(buffer) == CLIPS_PER_BUFFER:
                write(writer, buffer)
                buffer = []
        if buffer:
            write(writer, buffer)
    bad = stats.bad + len(skipped)
    if bad:
        print(f"{clips}: skipped {bad} corrupt clip(s) of {stats.records}: {'; '.join(skipped[:5])}"
              f"{' ...' if len(skipped) > 5 else ''}")
    if bad > max_bad_fraction * stats.records:
        raise SystemExit(f"{clips}: {bad} of {stats.records} clips are corrupt (over --max-bad-fraction "
                         f"{max_bad_fraction:.1%}); rebuild the clips (data/build_moving_shapes.py)")
    samples = sum(shapes.values())
    channels = next(iter(shapes)).split("x")[0] if shapes else "0"
    return {"samples": samples, "format_version": FORMAT_VERSION, "clips": str(clips),
            "shards": len(list(tmp.glob("*.tar"))), "latent_channels": int(channels),
            "text_dim": encoders.text.encoder.config.d_model, "shapes": dict(sorted(shapes.items())),
            "condition_channels": (channels_of(encoders.vae) if encoders.condition else 0),
            "image_dim": encoders.image.encoder.config.hidden_size if encoders.image else None,
            "example_keys": dict(sorted(example_keys.items())), "skipped_corrupt": bad}


def channels_of(vae: LatentEncoder) -> int:
    """Conditioning channels ``wan_i2v_condition`` builds: the frame mask's and the latent's."""
    return vae.geometry.temporal_factor + vae.geometry.latent_channels


def is_current(out: Path, digest: str) -> bool:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("format_version") == FORMAT_VERSION and manifest.get("inputs_sha256") == digest


def build(clips: Path, vae_path: Path, text_encoder_path: Path, train_out: Path, eval_out: Path,
          batch_frames: int = 256, max_bad_fraction: float = 0.01, conditioning: Conditioning = Conditioning()) -> None:
    """Precompute both splits unless they are current; under a lock, like every builder."""
    for split in ("train", "eval"):
        if not (clips / split / MANIFEST).exists():
            raise SystemExit(f"{clips / split} is not a built clip split; build it: python data/build_moving_shapes.py "
                             f"--train-out {clips / 'train'} --eval-out {clips / 'eval'}")
    text = load_text_encoder(text_encoder_path, clips)
    digest = inputs_sha256(clips, vae_path, text_encoder_path, conditioning)
    splits = {clips / "train": train_out, clips / "eval": eval_out}
    if all(is_current(out, digest) for out in splits.values()):
        print(f"cached: {train_out} and {eval_out} are current")
        return
    train_out.parent.mkdir(parents=True, exist_ok=True)
    with open(train_out.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        vae = load_vae(vae_path)
        image = conditioning.image_encoder
        encoders = Encoders(vae, text, conditioning.condition, load_image_encoder(image) if image else None)
        extra = {"inputs_sha256": digest, "vae": vae.describe(),
                 "text_encoder": {"path": str(text_encoder_path), "max_length": text.tokenizer.model_max_length},
                 "image_encoder": {"path": str(image)} if image else None}
        for split, out in splits.items():
            if not is_current(out, digest):
                # folders named relative to the split itself, so the cache can move with its inputs
                here = {"vae": {**extra["vae"], "path": os.path.relpath(vae_path.resolve(), out.resolve())},
                        "text_encoder": {**extra["text_encoder"],
                                         "path": os.path.relpath(text_encoder_path.resolve(), out.resolve())}}
                precompute_split(split, out, encoders, batch_frames, max_bad_fraction, {**extra, **here})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", required=True, type=Path, help="folder holding the clip splits train/ and eval/")
    parser.add_argument("--vae", required=True, type=Path)
    parser.add_argument("--text-encoder", required=True, type=Path, help="built here when missing")
    parser.add_argument("--out", type=Path, help="writes OUT/train and OUT/eval")
    parser.add_argument("--train-out", type=Path, help="instead of --out (as data.prepare passes them)")
    parser.add_argument("--eval-out", type=Path)
    parser.add_argument("--batch-frames", type=int, default=256, help="frames per VAE call")
    parser.add_argument("--max-bad-fraction", type=float, default=0.01)
    parser.add_argument("--condition", action="store_true",
                        help="image-to-video: store each clip's first-frame conditioning channels (Wan2.1 I2V)")
    parser.add_argument("--image-encoder", type=Path, default=None,
                        help="image-to-video: a local CLIPVisionModel folder; store its states of each first frame")
    args = parser.parse_args(argv)
    if (args.out is None) == (args.train_out is None or args.eval_out is None):
        parser.error("give either --out or both --train-out and --eval-out")
    train_out, eval_out = (args.out / "train", args.out / "eval") if args.out else (args.train_out, args.eval_out)
    try:
        build(args.clips, args.vae, args.text_encoder, train_out, eval_out, args.batch_frames, args.max_bad_fraction,
              Conditioning(args.condition, args.image_encoder))
    except EncoderError as error:
        raise SystemExit(f"[build_video_latents] {error}") from None


if __name__ == "__main__":
    main()
