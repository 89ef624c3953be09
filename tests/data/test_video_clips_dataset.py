"""The ``video_clips`` kind (raw clips encoded on the fly) against the ``video_latents`` kind on
latents precomputed from the same clips by data/build_video_latents.py, with a diffusers
AutoencoderKL built from config with random weights and the bundled tiny text encoder: the same
packed batches, exact resume, corrupt clips skipped and counted, and the launch check."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from tests.builders.test_video_latents_builder import DATA, tiny_vae
from veomni.config.schema import DataConfig
from veomni.data.build_loader import build_dataloader
from veomni.data.builders import load_script
from veomni.data.video.clips import check_video_clips

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

BUDGET = 400  # the largest clip, 9 frames of 48x48, is 324 patches of (1, 2, 2)


@dataclass(frozen=True)
class VideoModelFields:
    """What the kind reads of a video model's config (``VideoModelConfig``)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    in_channels: int = 4
    out_channels: int = 4
    text_dim: int = 64
    image_dim: int | None = None


MODEL = VideoModelFields()


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """Clips, a VAE, the text encoder and the latents precomputed from them."""
    root = tmp_path_factory.mktemp("video")
    shapes = load_script(DATA / "build_moving_shapes.py")
    shapes.build(root / "clips" / "train", root / "clips" / "eval", 99, train_samples=12, eval_samples=10)
    tiny_vae("kl").save_pretrained(root / "vae")
    precompute = load_script(DATA / "build_video_latents.py")
    precompute.build(root / "clips", root / "vae", root / "text_encoder", root / "latents" / "train",
                     root / "latents" / "eval", batch_frames=16)
    return {name: root / name for name in ("clips", "vae", "text_encoder", "latents")}


def clip_config(folders: dict[str, Path], **overrides) -> DataConfig:
    return DataConfig(**{"kind": "video_clips", "train_path": str(folders["clips"] / "train"),
                         "eval_path": str(folders["clips"] / "eval"), "vae": str(folders["vae"]),
                         "text_encoder": str(folders["text_encoder"]), "tokens_per_micro_batch": BUDGET,
                         **overrides})


def loader(cfg: DataConfig, split: str, seed: int = 3):
    return build_dataloader(cfg, split, None, 0, 1, seed, model_config=MODEL, kind=cfg.kind)


def assert_same_batch(batch: dict, expected: dict, atol: float) -> None:
    assert batch.keys() == expected.keys() and batch["captions"] == expected["captions"]
    for key, value in expected.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            torch.testing.assert_close(batch[key], value, atol=atol, rtol=0, msg=key)
        elif isinstance(value, torch.Tensor):
            assert torch.equal(batch[key], value), key
        else:
            assert batch[key] == value, key


def test_batches_equal_those_of_the_precomputed_latents(folders) -> None:
    latents = clip_config(folders, kind="video_latents", train_path=str(folders["latents"] / "train"),
                          eval_path=str(folders["latents"] / "eval"))
    expected = list(loader(latents, "eval"))
    batches = list(loader(clip_config(folders), "eval"))
    assert len(batches) == len(expected) > 1 and sum(len(b["captions"]) for b in batches) == 10
    for batch, reference in zip(batches, expected):
        # the precompute batches frames of several clips per VAE call: fp32 group norms differ by ~1e-5
        assert_same_batch(batch, reference, atol=1e-4)


def test_resume_after_k_batches_yields_the_same_next_batches(folders) -> None:
    cfg = clip_config(folders)
    reference_iter = iter(loader(cfg, "train"))
    reference = [next(reference_iter) for _ in range(5)]
    interrupted = loader(cfg, "train")
    it = iter(interrupted)
    for _ in range(2):
        next(it)
    resumed = loader(cfg, "train")
    resumed.load_state_dict(interrupted.state_dict())
    it = iter(resumed)
    for expected in reference[2:]:
        assert_same_batch(next(it), expected, atol=0)


def test_corrupt_clips_are_skipped_and_counted(folders, tmp_path, caplog) -> None:
    split = tmp_path / "eval"
    shutil.copytree(folders["clips"] / "eval", split)
    corrupt = load_script(DATA / "build_moving_shapes.py").add_corrupt_shard(split)
    cfg = clip_config(folders, eval_path=str(split), max_bad_fraction=0.5)
    reader = loader(cfg, "eval")
    assert sum(len(batch["captions"]) for batch in reader) == 10
    assert reader.dataset.state_dict()["bad_prior_epochs"] == 3
    assert all(f"sample {key} skipped" in caplog.text for key in corrupt)


def test_the_launch_check_names_missing_encoders_and_reads_the_clip_manifest(folders, tmp_path) -> None:
    cfg = clip_config(folders)
    assert check_video_clips(cfg, MODEL) == []
    problems = check_video_clips(replace(cfg, vae="", text_encoder=""), MODEL)
    assert [p.split(":")[0] for p in problems] == ["data.vae is not set", "data.text_encoder is not set"]
    problems = check_video_clips(replace(cfg, vae=str(tmp_path)), MODEL)
    assert len(problems) == 1 and problems[0].startswith(f"data.vae: {tmp_path} is not a diffusers VAE folder")

    def only_problem(cfg: DataConfig, model: VideoModelFields = MODEL) -> str:
        problems = check_video_clips(replace(cfg, eval_path=None), model)
        assert len(problems) == 1 and problems[0].startswith("data.train_path: "), problems
        return problems[0]

    odd_patch = check_video_clips(replace(cfg, eval_path=None), replace(MODEL, patch_size=(1, 3, 3)))
    assert any(re.fullmatch(r"data\.train_path: clips of \d+x32x\d+ \(FxHxW\) of .*: latent shape \[4, \d, 8, \d+\] "
                            r"\(C, F, H, W\): patch size \[1, 3, 3\] \(t, h, w\) does not divide .*", problem)
               for problem in odd_patch), odd_patch

    assert "have 4 channels, model.in_channels=16; set model.in_channels: 4" in only_problem(
        cfg, replace(MODEL, in_channels=16, out_channels=16))
    assert "are 64 wide, model.text_dim=32; set model.text_dim: 64" in only_problem(cfg, replace(MODEL, text_dim=32))
    assert re.search(r"the largest latent of .* shape \[4, 9, 12, 12\] \(e\.g\. clips of 9x48x48 \(FxHxW\)\), is 324 "
                     r"patches .* more than data\.tokens_per_micro_batch=100",
                     only_problem(replace(cfg, tokens_per_micro_batch=100)))
    coarse = tmp_path / "coarse_vae"  # six blocks: spatial factor 32, which 48-pixel clips do not fit
    coarse.mkdir()
    config = json.loads((folders["vae"] / "config.json").read_text())
    (coarse / "config.json").write_text(json.dumps({**config, "block_out_channels": [8] * 6}))
    unfit = check_video_clips(replace(cfg, eval_path=None, vae=str(coarse)), MODEL)
    assert any(re.fullmatch(rf"data\.train_path: .*: a \d+x\d+x\d+ \(FxHxW\) clip does not fit the "
                            rf"AutoencoderKL: it needs H and W divisible by 32 \(the VAE at {coarse}\)",
                            problem) for problem in unfit), unfit


def test_a_recipe_resolves_the_encoder_folders_and_fails_at_launch_without_them(folders, tmp_path, capsys) -> None:
    from veomni.launch import main

    recipe = tmp_path / "recipe.yaml"
    for name, folder in folders.items():
        (tmp_path / name).symlink_to(folder)
    recipe.write_text("model:\n  arch: dit\n  num_attention_heads: 2\n  attention_head_dim: 8\n  ffn_dim: 32\n"
                      "  num_layers: 1\n  in_channels: 4\n  out_channels: 4\n  text_dim: 64\n  freq_dim: 16\n"
                      "data:\n  kind: video_clips\n  train_path: clips/train\n  eval_path: clips/eval\n"
                      f"  vae: vae\n  tokens_per_micro_batch: {BUDGET}\n"
                      f"train:\n  output_dir: {tmp_path / 'out'}\n")
    assert main([str(recipe)]) == 2
    assert "config error: data.text_encoder is not set: the video_clips kind" in capsys.readouterr().err
    assert main([str(recipe), "--data.text_encoder", str(tmp_path / "text_encoder")]) == 0
