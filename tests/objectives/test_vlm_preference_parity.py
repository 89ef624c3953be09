"""Preference optimisation of a Qwen2.5-VL against transformers, which this project did not write.

Two ``Qwen2_5_VLForConditionalGeneration`` (the tiny recipe's folder, ``data/build_qwen_vl_random.py``,
narrowed to two layers of width 32 in the tower and the LLM) with different random weights are the
policy and the reference; the ``chat_media_preference`` kind
packs four pairs (two images, none, an image and a video, one image after a multi-turn prompt) into
one row. Each reply's summed log-probability under the policy and under the reference, taken by
``PreferenceTask`` from our packed model with the imported weights, equals the sum transformers'
model gives when it reads each half alone, fed its own image processor's pixel values and grids and
Qwen's published video processing (``tests/data/test_qwen_vl_video.py``), and computing its own
M-RoPE positions. The DPO loss and the policy's gradients (the vision tower's included, reached
through both halves) equal the same formula's on transformers' log-probabilities.
"""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import transformers
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from models.omni.mrope_positions import token_types
from models.omni.qwen_vl_adapter import config_from_hf, state_dict_from_hf
from tests.data.test_chat_media_jsonl import VIDEO_BUDGET
from tests.data.test_media_preference_data import (
    ANSWERS,
    CLIP_FPS,
    PAIR_IMAGES,
    PAIR_MEDIA,
    clip,
    media_pairs,
    pair_rows,
)
from tests.data.test_qwen_vl_video import expected_video
from tests.omni_utils import TOKENIZER, qwen_vl_random_builder, random_png
from tests.parity_utils import assert_grads_parity, assert_parity, assert_scalar_parity
from veomni.checkpoint.hf_io import load_hf_pretrained
from veomni.config.schema import RunConfig
from veomni.contract import get_model_spec
from veomni.data.text.packed import load_tokenizer
from veomni.objectives import FrozenModels, ObjectiveRequest, build_objective
from veomni.tasks.vlm import VLMTask

BETA = 0.5
SEEDS = {"policy": 0, "reference": 1}


def _hf(seed: int):
    builder = qwen_vl_random_builder()
    text = {**builder.TEXT, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "rope_parameters": {**builder.TEXT["rope_parameters"], "mrope_section": [1, 1, 2]}}
    vision = {**builder.VISION, "depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
              "out_hidden_size": 32, "fullatt_block_indexes": [1]}
    config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                                           **builder.TOKEN_IDS)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # transformers' init leaves norms at 1 and biases at 0: randomise everything
        for param in model.parameters():
            param.normal_(0.0, 0.05)
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm_dpo")
    for name, seed in SEEDS.items():
        _hf(seed).save_pretrained(tmp / name)
    _, config, _ = load_hf_pretrained(tmp / "policy")
    config.video_min_pixels, config.video_max_pixels = VIDEO_BUDGET.values()
    jsonl, _ = media_pairs(tmp)
    rows = pair_rows(jsonl, config, tokens_per_micro_batch=4000)
    assert len(rows) == 1 and int(rows[0]["cu_seqlens"].numel()) - 1 == 2 * len(ANSWERS), "one row of every pair"
    return SimpleNamespace(tmp=tmp, config=config, batch=rows[0])


def _ours(setup, name: str) -> torch.nn.Module:
    _, _, state = load_hf_pretrained(setup.tmp / name)
    model = get_model_spec("qwen2_5_vl").instantiate(setup.config)
    model.load_state_dict(state, strict=True)
    return model


def _our_run(setup, beta: float = BETA) -> SimpleNamespace:
    cfg = RunConfig()
    cfg.train.objective, cfg.preference.beta = "dpo", beta
    found = build_objective(ObjectiveRequest(cfg, VLMTask()))
    policy, reference = _ours(setup, "policy"), _ours(setup, "reference").requires_grad_(False).eval()
    found.attach(FrozenModels(policy, lambda: reference, False, None))
    task = found.task
    logps = task.pair_logps(policy, task.prepare(dict(setup.batch)))
    loss = task.loss(logps, task.options).losses.mean()  # what task(...) sums over pairs, without metrics
    loss.backward()
    return SimpleNamespace(logps=logps, loss=float(loss.detach()),
                           grads={name: p.grad for name, p in policy.named_parameters()})


def _hf_media(pair: int, config) -> dict:
    """transformers' inputs for pair ``pair``'s media: its image processor's pixels, Qwen's video rules."""
    vision = config.encoder_configs["image"]
    processor = Qwen2VLImageProcessorPil(min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)
    images = [Image.open(io.BytesIO(random_png(*PAIR_IMAGES[f]))) for f in PAIR_MEDIA[pair] if f in PAIR_IMAGES]
    kwargs = {}
    if images:
        pixels = processor(images=images, return_tensors="pt")
        kwargs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
    if "clips/d.npz" in PAIR_MEDIA[pair]:
        videos, grid, seconds = expected_video(clip(), CLIP_FPS, config)
        kwargs.update(pixel_values_videos=videos, video_grid_thw=grid, second_per_grid_ts=torch.tensor([seconds]))
    return kwargs


def _hf_logps(setup, model) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed log-probabilities of each pair's reply (its text and the eos closing
    it: the half's last tokens), each half read alone by transformers' model."""
    tokenizer = load_tokenizer(str(TOKENIZER))
    bounds = setup.batch["cu_seqlens"].tolist()
    sums = []
    for half, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        pair = half // 2
        reply = ANSWERS[pair][1 - half % 2]
        count = len(tokenizer.encode(reply, add_special_tokens=False)) + 1
        ids = setup.batch["input_ids"][start:stop]
        types = token_types(ids, setup.config.image_token_id, setup.config.video_token_id)[None]
        logits = model(input_ids=ids[None], mm_token_type_ids=types, **_hf_media(pair, setup.config)).logits[0]
        logps = F.log_softmax(logits[:-1].float(), -1).gather(-1, ids[1:, None])[:, 0]
        sums.append(logps[-count:].sum())
    sums = torch.stack(sums)
    return sums[0::2], sums[1::2]


def test_policy_and_reference_logps_loss_and_gradients_equal_transformers(setup) -> None:
    ours = _our_run(setup)
    policy, reference = _hf(SEEDS["policy"]), _hf(SEEDS["reference"])
    with torch.no_grad():
        ref_chosen, ref_rejected = _hf_logps(setup, reference)
    chosen, rejected = _hf_logps(setup, policy)
    assert_parity(ours.logps.chosen, chosen.detach(), "policy chosen log-probabilities")
    assert_parity(ours.logps.rejected, rejected.detach(), "policy rejected log-probabilities")
    assert_parity(ours.logps.ref_chosen, ref_chosen, "reference chosen log-probabilities")
    assert_parity(ours.logps.ref_rejected, ref_rejected, "reference rejected log-probabilities")
    margin = BETA * ((chosen - ref_chosen) - (rejected - ref_rejected))
    loss = -F.logsigmoid(margin).mean()  # DPO (Rafailov et al. 2023, eq. 7)
    assert margin.detach().abs().min() > 1e-3, "the reference differs from the policy on every pair"
    loss.backward()
    assert_scalar_parity(ours.loss, float(loss.detach()), "DPO loss")
    grads = state_dict_from_hf({n: p.grad for n, p in policy.named_parameters()}, config_from_hf(policy.config))
    assert any(name.startswith("encoders.") and g.abs().sum() > 0 for name, g in grads.items())
    assert_grads_parity(ours.grads, grads, "policy gradients")
