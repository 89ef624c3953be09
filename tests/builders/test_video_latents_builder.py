"""The tiny text encoder and the latent precompute: a seeded encoder folder that transformers loads
offline, and latent shards whose latents and text states equal calling diffusers' VAE (built here
from config with random weights) and the encoder directly on each clip; corrupt clips skipped and
counted, a threshold above which the precompute fails, and a cache that is kept until its inputs
change."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKL, AutoencoderKLWan
from safetensors.torch import load
from transformers import AutoTokenizer, UMT5EncoderModel

from tests.parity_utils import assert_parity
from veomni.data.builders import load_script
from veomni.data.sources import ReadStats, iter_tar_samples
from veomni.data.video.clip_format import decode_clip

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clips")
    builder = load_script(DATA / "build_moving_shapes.py")
    builder.build(root / "train", root / "eval", 1234, train_samples=40, eval_samples=12)
    return root


@pytest.fixture(scope="module")
def text_encoder(clips, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("te") / "text_encoder"
    builder = load_script(DATA / "build_text_encoder.py")
    builder.build_text_encoder(out, builder.caption_vocabulary(clips / "train"), seed=0)
    return out


def test_text_encoder_is_seeded_and_loads_offline(clips, text_encoder, tmp_path) -> None:
    builder = load_script(DATA / "build_text_encoder.py")
    tokenizer = AutoTokenizer.from_pretrained(text_encoder)
    encoder = UMT5EncoderModel.from_pretrained(text_encoder)
    assert encoder.config.d_model == 64 and encoder.config.num_layers == 2
    ids = tokenizer("a small red circle moving left slowly")["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens == ["a", "small", "red", "circle", "moving", "left", "slowly", "[EOS]"]
    assert tokenizer.convert_ids_to_tokens(tokenizer("A zebra")["input_ids"]) == ["a", "[UNK]", "[EOS]"]
    again = tmp_path / "again"
    builder.build_text_encoder(again, builder.caption_vocabulary(clips / "train"), seed=0)
    twin = UMT5EncoderModel.from_pretrained(again)
    assert all(torch.equal(a, b) for a, b in zip(encoder.state_dict().values(), twin.state_dict().values()))
    other = builder.make_encoder(len(tokenizer), seed=1)
    assert not torch.equal(other.shared.weight, encoder.shared.weight)


def tiny_vae(kind: str, scaling: float = 0.7):
    """A random diffusers VAE of spatial factor 4 and 4 latent channels (Wan: temporal factor 4)."""
    torch.manual_seed(0)
    if kind == "kl":
        return AutoencoderKL(block_out_channels=(8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 3,
                             up_block_types=("UpDecoderBlock2D",) * 3, latent_channels=4, norm_num_groups=4,
                             scaling_factor=scaling, shift_factor=0.1).eval()
    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2], num_res_blocks=1, temperal_downsample=[True, True],
                            latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0],
                            scale_factor_spatial=4, scale_factor_temporal=4).eval()


@torch.no_grad()
def direct_latent(vae, frames: np.ndarray) -> torch.Tensor:
    """Call the VAE on one clip as diffusers documents it: [C, F', H', W'] normalised latent."""
    pixels = torch.from_numpy(frames).permute(0, 3, 1, 2).float() / 127.5 - 1  # [F, 3, H, W]
    if isinstance(vae, AutoencoderKLWan):
        mean = vae.encode(pixels.transpose(0, 1)[None]).latent_dist.mean[0]
        mean_c, std_c = (torch.tensor(values).view(-1, 1, 1, 1) for values in (vae.config.latents_mean,
                                                                            vae.config.latents_std))
        return (mean - mean_c) / std_c
    mean = vae.encode(pixels).latent_dist.mean.transpose(0, 1)
    return (mean - vae.config.shift_factor) * vae.config.scaling_factor


def read_latents(split: Path) -> dict[str, tuple[dict, dict]]:
    """key -> (tensors, json) of a latent split."""
    stats = ReadStats()
    samples = list(iter_tar_samples(sorted(split.glob("*.tar")), 0.0, stats))
    return {s["__key__"]: (load(s["latent.safetensors"]), json.loads(s["json"])) for s in samples}


def clips_by_key(split: Path) -> dict:
    return {c.key: c for c in map(decode_clip, iter_tar_samples(sorted(split.glob("*.tar")), 0.0, ReadStats()))}


@pytest.mark.parametrize("kind", ["kl", "wan"])
def test_latents_and_text_equal_calling_the_models(kind, clips, text_encoder, tmp_path) -> None:
    vae = tiny_vae(kind)
    vae.save_pretrained(tmp_path / "vae")
    out = tmp_path / "latents"
    precompute = load_script(DATA / "build_video_latents.py")
    precompute.build(clips, tmp_path / "vae", text_encoder, out / "train", out / "eval", batch_frames=16)
    tokenizer, encoder = AutoTokenizer.from_pretrained(text_encoder), UMT5EncoderModel.from_pretrained(text_encoder)
    for split in ("train", "eval"):
        manifest = json.loads((out / split / "manifest.json").read_text())
        latents, originals = read_latents(out / split), clips_by_key(clips / split)
        assert latents.keys() == originals.keys() and manifest["samples"] == len(latents)
        assert manifest["skipped_corrupt"] == 0 and manifest["latent_channels"] == 4 and manifest["text_dim"] == 64
        assert manifest["vae"]["class"] == type(vae).__name__ and manifest["vae"]["spatial_factor"] == 4
        assert manifest["vae"]["temporal_factor"] == (4 if kind == "wan" else 1)
        assert manifest["text_encoder"]["max_length"] == tokenizer.model_max_length
        # folders are named relative to the split, so the latent cache can move with its inputs
        assert (out / split / manifest["text_encoder"]["path"]).resolve() == Path(text_encoder).resolve()
        assert (out / split / manifest["vae"]["path"]).resolve() == (tmp_path / "vae").resolve()
        shapes = {}
        for key, (tensors, meta) in latents.items():
            clip = originals[key]
            assert meta == {**clip.meta, "latent_shape": list(tensors["latent"].shape)}
            with torch.no_grad():
                states = encoder(**tokenizer(meta["caption"], return_tensors="pt")).last_hidden_state[0]
            assert_parity(tensors["text"], states, "tensors['text']")
            name = "x".join(map(str, meta["latent_shape"]))
            shapes[name] = shapes.get(name, 0) + 1
            if manifest["example_keys"][name] == key:  # one clip of each shape is encoded again here
                # fp32 group norms of flat backgrounds: batched or not, each call is ~2e-4 from an fp64 call
                torch.testing.assert_close(tensors["latent"], direct_latent(vae, clip.frames), atol=1e-3, rtol=1e-3)
        assert manifest["shapes"] == shapes and manifest["example_keys"].keys() == shapes.keys()


def test_corrupt_clips_are_skipped_counted_and_bounded(clips, text_encoder, tmp_path, capsys) -> None:
    copy = tmp_path / "clips"
    shutil.copytree(clips, copy)
    corrupt = load_script(DATA / "build_moving_shapes.py").add_corrupt_shard(copy / "train")
    tiny_vae("kl").save_pretrained(tmp_path / "vae")
    precompute = load_script(DATA / "build_video_latents.py")
    out = tmp_path / "latents"
    with pytest.raises(SystemExit, match="3 of 43 clips are corrupt"):
        precompute.build(copy, tmp_path / "vae", text_encoder, out / "train", out / "eval")
    assert not (out / "train").exists() and not any(p.name.startswith(".train") for p in out.iterdir())
    precompute.build(copy, tmp_path / "vae", text_encoder, out / "train", out / "eval", max_bad_fraction=0.1)
    manifest = json.loads((out / "train" / "manifest.json").read_text())
    assert manifest["skipped_corrupt"] == 3 and manifest["samples"] == 40
    assert not set(corrupt) & set(read_latents(out / "train"))
    assert "skipped 3 corrupt clip(s) of 43" in capsys.readouterr().out


def test_cache_is_kept_until_the_vae_changes(clips, text_encoder, tmp_path, capsys) -> None:
    tiny_vae("kl").save_pretrained(tmp_path / "vae")
    precompute = load_script(DATA / "build_video_latents.py")
    args = (clips, tmp_path / "vae", text_encoder, tmp_path / "out" / "train", tmp_path / "out" / "eval")
    precompute.build(*args)
    before = read_latents(tmp_path / "out" / "eval")
    precompute.main(["--clips", str(clips), "--vae", str(tmp_path / "vae"), "--text-encoder", str(text_encoder),
                     "--out", str(tmp_path / "out")])
    assert "cached" in capsys.readouterr().out
    tiny_vae("kl", scaling=1.4).save_pretrained(tmp_path / "vae")
    precompute.build(*args)
    after = read_latents(tmp_path / "out" / "eval")
    assert json.loads((tmp_path / "out" / "eval" / "manifest.json").read_text())["vae"]["scaling_factor"] == 1.4
    for key, (tensors, _) in before.items():
        torch.testing.assert_close(after[key][0]["latent"], 2 * tensors["latent"])
