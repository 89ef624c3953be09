"""Image-to-video conditioning in the ``video_latents`` kind: a cache holding each sample's
``condition`` channels and first-frame image states packs them into the row as the flow task and
the DiT read them, and a cache that lacks them or holds them in the wrong shape is refused: at
launch from the manifest (naming a sample), and per sample when it is read (naming it)."""

from __future__ import annotations

import io
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors

from veomni.config.schema import DataConfig
from veomni.data.build_loader import build_dataloader
from veomni.data.sources import BadDataError
from veomni.data.video.latents import check_video_latents
from veomni.ops.video_patch import patchify
from veomni.tasks.flow import DiffusionTask

TEXT_DIM, IMAGE_DIM, CONDITION = 8, 6, 5  # condition: a 1-channel frame mask + the 4-channel first-frame latent
SHAPES = [(4, 3, 4, 4), (4, 1, 4, 8), (4, 5, 4, 4)]


@dataclass
class I2VFields:
    """What the kind reads of a video model's config (``VideoModelConfig``)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    in_channels: int = 4 + CONDITION
    out_channels: int = 4
    text_dim: int = TEXT_DIM
    image_dim: int | None = IMAGE_DIM


def write_split(folder: Path, samples: int = 6, condition: bool = True, image: bool = True,
                damage: dict[int, dict] | None = None) -> dict[str, dict]:
    """A latent split with per-sample ``condition`` / ``image`` tensors and a manifest saying so;
    ``damage``: index -> tensors that replace (value None: remove) the sample's own."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    written, shapes, examples = {}, {}, {}
    with tarfile.open(folder / "shard-00000.tar", "w") as tar:
        for index in range(samples):
            key, shape = f"clip{index:04d}", SHAPES[index % len(SHAPES)]
            tensors = {"latent": torch.randn(shape, generator=g),
                       "text": torch.randn(2 + index % 3, TEXT_DIM, generator=g)}
            if condition:
                tensors["condition"] = torch.randn(CONDITION, *shape[1:], generator=g)
            if image:
                tensors["image"] = torch.randn(3 + index % 2, IMAGE_DIM, generator=g)
            for name, tensor in (damage or {}).get(index, {}).items():
                tensors.pop(name) if tensor is None else tensors.__setitem__(name, tensor)
            written[key] = tensors
            shapes["x".join(map(str, shape))] = shapes.get("x".join(map(str, shape)), 0) + 1
            examples.setdefault("x".join(map(str, shape)), key)
            meta = {"caption": f"caption of {key}", "latent_shape": list(shape)}
            for member, data in ((f"{key}.latent.safetensors", save_safetensors(tensors)),
                                 (f"{key}.json", json.dumps(meta).encode())):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    manifest = {"format_version": 3, "latent_channels": 4, "text_dim": TEXT_DIM, "shapes": shapes,
                "example_keys": examples, "skipped_corrupt": 0, "condition_channels": CONDITION if condition else 0,
                "image_dim": IMAGE_DIM if image else None}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return written


def _config(path: Path, **overrides) -> DataConfig:
    return DataConfig(**{"kind": "video_latents", "train_path": str(path), "eval_path": None,
                         "tokens_per_micro_batch": 64, **overrides})


def _rows(path: Path, model: I2VFields | None = None, **overrides) -> list[dict]:
    loader = build_dataloader(_config(path, eval_path=str(path), **overrides), "eval", None, 0, 1, 0,
                              model_config=model or I2VFields(), kind="video_latents")
    return list(loader)


def test_rows_carry_each_samples_condition_and_image_states(tmp_path):
    written = write_split(tmp_path / "split")
    rows = _rows(tmp_path / "split")
    assert sum(len(row["captions"]) for row in rows) == len(written)
    for row in rows:
        keys = [caption.removeprefix("caption of ") for caption in row["captions"]]
        expected = torch.cat([patchify(written[k]["condition"], (1, 2, 2)) for k in keys])
        assert torch.equal(row["condition"], expected) and row["condition"].shape[1] == CONDITION * 4
        assert torch.equal(row["image_states"], torch.cat([written[k]["image"] for k in keys]))
        assert row["image_cu_seqlens"].tolist() == [0, *torch.tensor([len(written[k]["image"]) for k in keys])
                                                    .cumsum(0).tolist()]
        prepared = DiffusionTask().prepare(row, torch.Generator().manual_seed(0))
        assert prepared["noisy"].shape[1] == (4 + CONDITION) * 4 and prepared["target"].shape[1] == 4 * 4
        assert torch.equal(prepared["noisy"][:, 16:], expected)  # the conditioning rides along unnoised


def test_a_text_to_video_model_reads_the_same_cache_without_its_conditioning(tmp_path):
    write_split(tmp_path / "split", condition=False, image=False)
    row = _rows(tmp_path / "split", I2VFields(in_channels=4, image_dim=None))[0]
    assert "condition" not in row and "image_states" not in row


@pytest.mark.parametrize("split_has, model, message", [
    ({"condition": False}, I2VFields(),
     r"model\.in_channels=9 is out_channels=4 plus 5 conditioning channels .* the latents of .* \(sample 'clip0\d+' "
     r"and every other\) hold no conditioning channels; rebuild them with data/build_video_latents\.py --condition"),
    ({}, I2VFields(in_channels=4 + 8),
     r"plus 8 conditioning channels .* hold 5 conditioning channels; set model\.in_channels: 9"),
    ({"image": False}, I2VFields(),
     r"model\.image_dim=6, but the latents of .* \(sample 'clip0\d+' and every other\) hold no image encoder "
     r"states; rebuild them with data/build_video_latents\.py --image-encoder"),
    ({}, I2VFields(image_dim=12), r"model\.image_dim=12, but .* hold image states 6 wide; set model\.image_dim: 6"),
    ({}, I2VFields(image_dim=None), r"model\.image_dim=None, but .* hold image states 6 wide; set model\.image_dim"),
], ids=["no-condition", "condition-width", "no-image", "image-width", "image-unused"])
def test_the_launch_check_refuses_conditioning_the_cache_does_not_hold(tmp_path, split_has, model, message):
    write_split(tmp_path / "split", **split_has)
    problems = check_video_latents(_config(tmp_path / "split"), model)
    assert len(problems) == 1 and re.search(message, problems[0]), problems
    assert problems[0].startswith("data.train_path: ")
    assert check_video_latents(_config(tmp_path / "split"), I2VFields(**{
        "in_channels": 4 + (CONDITION if split_has.get("condition", True) else 0),
        "image_dim": IMAGE_DIM if split_has.get("image", True) else None})) == []


@pytest.mark.parametrize("damage, message", [
    ({"condition": None}, r"clip0001 skipped: .*no 'condition' tensor"),
    ({"condition": torch.zeros(CONDITION, 1, 2, 8)}, r"clip0001 skipped: .*condition of shape \[5, 1, 2, 8\], the "
                                                      r"model reads \[5, 1, 4, 8\]"),
    ({"condition": torch.zeros(CONDITION + 1, 1, 4, 8)}, r"clip0001 skipped: .*condition of shape \[6, 1, 4, 8\]"),
    ({"image": None}, r"clip0001 skipped: .*no 'image' tensor"),
    ({"image": torch.zeros(3, IMAGE_DIM + 1)}, r"clip0001 skipped: .*image states of shape \[3, 7\], the model "
                                               r"reads \[L, 6\]"),
], ids=["no-condition", "condition-size", "condition-channels", "no-image", "image-width"])
def test_a_sample_whose_conditioning_disagrees_is_refused_by_name(tmp_path, caplog, damage, message):
    write_split(tmp_path / "split", damage={1: damage})
    rows = _rows(tmp_path / "split", max_bad_fraction=0.2)
    assert sum(len(row["captions"]) for row in rows) == 5 and re.search(message, caplog.text), caplog.text
    with pytest.raises(BadDataError, match=r"1 of 6 records were bad"):
        _rows(tmp_path / "split", max_bad_fraction=0.0)
