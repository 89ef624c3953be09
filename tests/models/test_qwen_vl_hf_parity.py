"""Whole Qwen2.5-VL and Qwen2-VL against transformers, built from small configs with random weights.

A folder written by ``Qwen*VLForConditionalGeneration.save_pretrained`` is imported through the
engine's ``checkpoint.init_from_hf`` path (``load_hf_pretrained``, ``check_init``); our packed row
of two samples (text, two images of different sizes, a video of two temporal patches; per-sample
attention) gives the logits transformers gives for each sample alone, fed the same pixel values
and grids, with transformers computing its own M-RoPE positions from ``mm_token_type_ids``. Then
our export loads back into transformers with the same logits. Qwen3-VL folders are refused.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from models.omni.mrope_positions import token_types
from tests.parity_utils import assert_parity
from veomni.checkpoint.component_init import check_init, read_folder
from veomni.checkpoint.hf_io import load_hf_pretrained, save_hf_pretrained
from veomni.contract import build_config, get_model_spec

IMAGE, VIDEO, START, END = 190, 191, 192, 193
ROPE_THETA = 10.0
"""With head dim 16 the width block gets the slowest 3 of 8 frequencies, ``theta ** (-5/8 .. -7/8)``:
at 10000 they turn 0.003 rad or less per patch and a lost or swapped axis hides below rounding;
at 10 they turn 0.13-0.24 rad per patch, so each axis moves the logits (issue 47)."""
TEXT = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA, "mrope_section": [2, 3, 3]})
VISION = {
    # patch 2 px, 2x2 merge; windows of 8 px = 2x2 merged tokens, layer 1 attends whole frames
    "qwen2_5_vl": dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                       patch_size=2, spatial_merge_size=2, temporal_patch_size=2, window_size=8,
                       fullatt_block_indexes=[1], tokens_per_second=4),
    "qwen2_vl": dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2,
                     spatial_merge_size=2, temporal_patch_size=2),
}
CLASSES = {"qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
           "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration")}
# (grid_thw, is_video) per media item of each sample, in order; grids in patches
# images of distinct height and width (a transposed one in the other sample), a video of 3 x 2 x 4
SAMPLES = [[((1, 4, 10), False), ((4, 6, 8), True)], [((1, 10, 4), False)]]
SECONDS = 1.5  # per temporal patch of the video: time positions step by tokens_per_second * 1.5 = 6


def _hf_model(variant: str, tied: bool, temporal: int = 2):
    config_name, model_name = CLASSES[variant]
    config = getattr(transformers, config_name)(
        text_config=TEXT, vision_config={**VISION[variant], "temporal_patch_size": temporal},
        image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0: randomise everything
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    return model


def _samples(patch_dim: int):
    """Per sample: token ids, and its images' / videos' pixel values and grids."""
    gen = torch.Generator().manual_seed(1)
    samples = []
    for items in SAMPLES:
        ids = [torch.randint(0, 180, (5,), generator=gen)]
        media = {False: ([], []), True: ([], [])}
        for grid, is_video in items:
            t, h, w = grid
            ids += [torch.tensor([START]), torch.full((t * h * w // 4,), VIDEO if is_video else IMAGE),
                    torch.tensor([END]), torch.randint(0, 180, (3,), generator=gen)]
            media[is_video][0].append(torch.randn(t * h * w, patch_dim, generator=gen))
            media[is_video][1].append(grid)
        samples.append((torch.cat(ids), media))
    return samples


def _hf_logits(model, variant: str, samples) -> list[torch.Tensor]:
    out = []
    for ids, media in samples:
        kwargs = {"mm_token_type_ids": token_types(ids, IMAGE, VIDEO)[None]}
        for is_video, (pixels, grids) in media.items():
            if grids:
                key = "_videos" if is_video else ""
                kwargs[f"pixel_values{key}"] = torch.cat(pixels)
                kwargs["video_grid_thw" if is_video else "image_grid_thw"] = torch.tensor(grids)
        if variant == "qwen2_5_vl" and media[True][1]:
            kwargs["second_per_grid_ts"] = torch.tensor([SECONDS] * len(media[True][1]))
        with torch.no_grad():
            out.append(model(input_ids=ids[None], **kwargs).logits[0])
    return out


def _our_logits(model, cfg, samples) -> list[torch.Tensor]:
    """One packed row of all samples; one encoder call on every image and video, in row order."""
    ids = torch.cat([s[0] for s in samples])
    lengths = torch.tensor([len(s[0]) for s in samples])
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    patches, grids, images, videos = [], [], [], []
    for _, media in samples:  # a sample's images come before its video in SAMPLES, as in its row
        for is_video in (False, True):
            patches += media[is_video][0]
            grids += media[is_video][1]
            (videos if is_video else images).extend(media[is_video][1])
    positions = cfg.position_ids(ids, cu_seqlens, torch.tensor(images), torch.tensor(videos),
                                 torch.tensor([SECONDS] * len(videos)))
    media = {"image": {"inputs": {"patches": torch.cat(patches), "grid_thw": torch.tensor(grids)},
                       "positions": torch.nonzero(token_types(ids, IMAGE, VIDEO)).flatten()}}
    with torch.no_grad():
        logits = model(ids, positions, cu_seqlens, int(lengths.max()), media=media)
    return list(logits.split(lengths.tolist()))


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (ours, theirs) in enumerate(zip(got, want)):
        assert ours.shape == theirs.shape
        assert_parity(ours, theirs, f"{what}, sample {i}")


@pytest.mark.parametrize("variant,tied,temporal", [("qwen2_5_vl", False, 2), ("qwen2_vl", True, 2),
                                                   ("qwen2_vl", False, 1)])
def test_import_and_export_match_transformers(variant, tied, temporal, tmp_path) -> None:
    """Also: the exported config.json states every field of the imported one the family reads as
    the folder did (a one-frame temporal patch stays one frame, not the per-frame tower's 2)."""
    reference = _hf_model(variant, tied, temporal)
    reference.save_pretrained(tmp_path / "hf")
    arch, cfg, state_dict = load_hf_pretrained(tmp_path / "hf")
    assert arch == "qwen2_5_vl" and cfg.variant == variant and cfg.llm_config.tie_embeddings == tied
    model = get_model_spec(arch).instantiate(cfg).eval()
    assert check_init(model, {"": str(tmp_path / "hf")}) == []
    model.load_state_dict(state_dict, strict=True)

    samples = _samples(cfg.encoder_configs["image"].patch_dim)
    want = _hf_logits(reference, variant, samples)
    _assert_same(_our_logits(model, cfg, samples), want, "imported")

    save_hf_pretrained(arch, cfg, model.state_dict(), tmp_path / "export")
    _assert_same_fields(tmp_path / "hf", tmp_path / "export")
    exported = getattr(transformers, CLASSES[variant][1]).from_pretrained(tmp_path / "export").eval()
    _assert_same(_hf_logits(exported, variant, samples), want, "exported")


def _assert_same_fields(source, exported) -> None:
    want, got = (json.loads((folder / "config.json").read_text()) for folder in (source, exported))
    for section in ("text_config", "vision_config"):
        fields = set(TEXT) if section == "text_config" else set(want[section])
        differ = {k: (want[section][k], got[section].get(k)) for k in fields if got[section].get(k) != want[section][k]}
        assert not differ, f"{section}: (imported, exported) {differ}"
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                 "tie_word_embeddings", "model_type"):
        assert got[name] == want[name], name


def test_positions_equal_get_rope_index() -> None:
    """Per sample, our packed-row positions are transformers' ``get_rope_index``."""
    reference = _hf_model("qwen2_5_vl", tied=False)
    cfg = get_model_spec("qwen2_5_vl").hf_adapter.config_from_hf(reference.config)
    samples = _samples(cfg.encoder_configs["image"].patch_dim)
    ids = torch.cat([s[0] for s in samples])
    lengths = torch.tensor([len(s[0]) for s in samples])
    cu_seqlens = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    images = [g for _, m in samples for g in m[False][1]]
    videos = [g for _, m in samples for g in m[True][1]]
    ours = cfg.position_ids(ids, cu_seqlens, torch.tensor(images), torch.tensor(videos),
                            torch.tensor([SECONDS] * len(videos))).split(lengths.tolist())
    for (sample_ids, media), got in zip(samples, ours):
        want, _ = reference.model.get_rope_index(
            sample_ids[None], token_types(sample_ids, IMAGE, VIDEO)[None],
            image_grid_thw=torch.tensor(media[False][1]),
            video_grid_thw=torch.tensor(media[True][1]) if media[True][1] else None,
            second_per_grid_ts=torch.tensor([SECONDS] * len(media[True][1])) if media[True][1] else None)
        assert torch.equal(got, want[:, 0].T)
    with pytest.raises(ValueError, match="grids given but the row holds"):
        cfg.position_ids(ids, cu_seqlens, torch.tensor(images + [(1, 2, 2)]), torch.tensor(videos))


def test_qwen3_vl_folder_is_refused_with_the_reason(tmp_path) -> None:
    transformers.Qwen3VLConfig().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="Qwen3-VL .* is not supported: .*DeepStack"):
        read_folder(tmp_path)


def test_a_recipe_fits_the_folder_option_by_option(tmp_path) -> None:
    """A recipe states only some options of ``llm`` and ``encoders.image`` (the rest default) and
    sets free ones apart from the folder: it fits; a differing option is named by its dotted path."""
    _hf_model("qwen2_5_vl", tied=False).save_pretrained(tmp_path)
    llm = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
               head_dim=None, rope_theta=ROPE_THETA, rms_norm_eps=1e-5, tie_embeddings=False, qkv_bias=True,
               qk_norm=False, family="qwen2", mrope_section=[2, 3, 3], max_position_embeddings=4096)
    image = dict(patch_size=2, hidden_size=32, num_layers=3, num_heads=2, intermediate_size=48, hidden_act="silu",
                 merge_mode="concat", out_hidden_size=64, temporal_patch_size=2, norm="rmsnorm", mlp="gated",
                 window_size=8, full_attention_layers=[1], max_pixels=56 * 56)
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
               tokens_per_second=4)
    spec = get_model_spec("qwen2_5_vl")

    def problems(**llm_changes):
        cfg = build_config("qwen2_5_vl", {"llm": {**llm, **llm_changes}, "encoders": {"image": image}, **ids})
        with torch.device("meta"):
            return check_init(spec.instantiate(cfg), {"": str(tmp_path)})

    assert problems() == []
    [problem] = problems(rms_norm_eps=1e-6)
    assert "llm.rms_norm_eps: recipe 1e-06, folder 1e-05" in problem
