"""The chat-with-media loader under a ``qwen2_5_vl`` model applies Qwen's own processor rules: an image
of an odd size gives transformers' ``Qwen2_5_VLProcessor`` pixel values, ``image_grid_thw`` and token
ids (``<|vision_start|>``, one ``<|image_pad|>`` per merged token, ``<|vision_end|>``), built offline
from the PIL image processor and the bundled tokenizer; the packed row carries the M-RoPE positions
[T, 3] of each sample, and gives transformers' logits; a tokenizer giving the layout's tokens other ids
than the config's is refused."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from models.omni.mrope_positions import token_types
from models.vit.processing import qwen_smart_resize
from tests.omni_utils import (
    TINY_QWEN_VL_CHAT,
    TOKENIZER,
    chat_record,
    qwen_vl_random_builder,
    random_png,
    tiny_qwen_vl_chat,
    write_shard,
)
from tests.parity_utils import assert_parity
from veomni.checkpoint.hf_io import load_hf_pretrained
from veomni.config.schema import DataConfig
from veomni.contract import build_config, get_model_spec
from veomni.data.chat.media_dataset import SampleProcessor, check_chat_media_data
from veomni.data.text.packed import load_tokenizer

# odd sides, one of them above the pixel budget: smart resize scales down and floors
SIZES = [(61, 97), (37, 23), (150, 59)]


def _hf_processor(tokenizer, vision) -> Qwen2_5_VLProcessor:
    """transformers' processor from parts made here (no download). Its video processor needs
    torchvision, which this environment lacks; images never touch it, so the class check of that
    one argument is skipped."""
    image_processor = Qwen2VLImageProcessorPil(min_pixels=vision.min_pixels, max_pixels=vision.max_pixels,
                                               patch_size=vision.patch_size, merge_size=vision.merge_size,
                                               temporal_patch_size=vision.temporal_patch_size)
    original = Qwen2_5_VLProcessor.check_argument_for_proper_class
    Qwen2_5_VLProcessor.check_argument_for_proper_class = lambda self, name, arg: None
    try:
        return Qwen2_5_VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None)
    finally:
        Qwen2_5_VLProcessor.check_argument_for_proper_class = original


@pytest.mark.parametrize("height,width", SIZES)
def test_a_sample_is_what_transformers_processor_makes(height, width):
    config = build_config("qwen2_5_vl", TINY_QWEN_VL_CHAT)
    vision = config.encoder_configs["image"]
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    sample = process(chat_record("a", "What color?", "red", random_png(height, width, height)))
    item = sample.media["image"][0]

    tokenizer = process.chat.tokenizer
    hf = _hf_processor(tokenizer, vision)
    # Qwen's layout of the image in the user turn; our plain template tokenizes the text between
    # markers piece by piece ("User: ", the image, "\nWhat color?", "\n", "Assistant: ", the answer)
    prompt = "User: <|vision_start|><|image_pad|><|vision_end|>"
    want = hf(images=[Image.open(io.BytesIO(random_png(height, width, height)))], text=[prompt], return_tensors="pt")
    torch.testing.assert_close(item.inputs["grid_thw"], want["image_grid_thw"], rtol=0, atol=0)
    torch.testing.assert_close(item.inputs["patches"], want["pixel_values"].float(), rtol=0, atol=1e-5)
    rest = [tokenizer.encode(t, add_special_tokens=False) for t in ("\nWhat color?", "\n", "Assistant: ", "red")]
    assert sample.chat.ids == want["input_ids"][0].tolist() + sum(rest, []) + [tokenizer.eos_token_id]
    merged = int(want["image_grid_thw"].prod()) // vision.merge_size**2
    assert item.num_tokens == merged and item.cost == int(want["image_grid_thw"].prod())
    assert sample.cost == len(sample.chat.ids) + item.cost
    assert [sample.chat.ids[i] for i in sample.chat.placeholders["image"]] == [config.image_token_id] * merged


def test_qwen_resize_is_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for height in range(20, 400, 7):
        for width in (23, 57, 100, 333):
            for budget in ((28 * 28, 84 * 84), (56 * 56, 28 * 28 * 1280), (3136, 12845056)):
                assert qwen_smart_resize(height, width, 28, *budget) == smart_resize(height, width, 28, *budget)


def test_packed_row_has_each_samples_mrope_positions():
    config = build_config("qwen2_5_vl", TINY_QWEN_VL_CHAT)
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    samples = [process(chat_record("a", "What color?", "red", random_png(61, 97, 1))),
               process(chat_record("b", "Text only?", "yes")),
               process(chat_record("c", "Shape?", "circle", random_png(150, 59, 2)))]
    batch = process.pack(samples)
    positions = batch["position_ids"]
    assert positions.shape == (batch["input_ids"].numel(), 3)
    grids = batch["media"]["image"]["inputs"]["grid_thw"]
    assert torch.equal(positions, config.position_ids(batch["input_ids"], batch["cu_seqlens"], grids))
    assert positions[batch["cu_seqlens"][:-1].long()].eq(0).all()  # every sample starts at 0
    image = batch["media"]["image"]["positions"][: samples[0].media["image"][0].num_tokens]
    t, h, w = grids[0].tolist()
    start = image[0].item()
    # an image's tokens take (start, start + row, start + column) of its merged grid
    assert torch.equal(positions[image, 1] - positions[image[0], 1], torch.arange(h // 2).repeat_interleave(w // 2))
    assert torch.equal(positions[image, 2] - positions[image[0], 2], torch.arange(w // 2).repeat(h // 2))
    assert positions[start - 1, 0] + 1 == positions[start, 0]  # right after <|vision_start|>
    _, model = tiny_qwen_vl_chat()  # the row is what the model takes: one feature per placeholder
    logits = model(batch["input_ids"], positions, batch["cu_seqlens"], batch["max_seqlen"], media=batch["media"])
    assert logits.shape == (positions.shape[0], 8200) and logits.isfinite().all()


def test_a_tokenizer_with_other_ids_is_refused():
    config = build_config("qwen2_5_vl", {**TINY_QWEN_VL_CHAT, "image_token_id": 8196, "video_token_id": 8194})
    with pytest.raises(ValueError, match=r"gives <\|image_pad\|> id 8195, the model config expects 8196"):
        SampleProcessor(load_tokenizer(str(TOKENIZER)), config)


def test_launch_check_names_a_wrong_id(tmp_path):
    """The launcher's pre-flight check of the kind says the same before any worker starts."""
    config = build_config("qwen2_5_vl", {**TINY_QWEN_VL_CHAT, "image_token_id": 8196, "video_token_id": 8194})
    write_shard(tmp_path / "train" / "shard-000000.tar", [chat_record("a", "Q?", "yes", random_png(40, 40, 0))])
    cfg = DataConfig(train_path=str(tmp_path / "train"), tokenizer=str(TOKENIZER))
    assert check_chat_media_data(cfg, build_config("qwen2_5_vl", TINY_QWEN_VL_CHAT)) == []
    problems = check_chat_media_data(cfg, config)
    assert any("<|image_pad|> id 8195" in p for p in problems), problems


def test_loader_rows_give_transformers_logits(tmp_path):
    """End to end: the tiny recipe's folder shape (``data/build_qwen_vl_random.py``) with every weight
    randomised, imported; our loader's packed row of three chat samples (odd-sized images, text only)
    gives, per sample, the logits transformers' model gives on its image processor's pixel values
    and grid, computing its own M-RoPE positions."""
    reference = qwen_vl_random_builder().make_model(seed=0)
    with torch.no_grad():  # transformers' init leaves norms at 1 and biases at 0: randomise everything
        for param in reference.parameters():
            param.normal_(0.0, 0.05)
    reference.save_pretrained(tmp_path / "hf")
    _, config, state = load_hf_pretrained(tmp_path / "hf")
    model = get_model_spec("qwen2_5_vl").instantiate(config).eval()
    model.load_state_dict(state, strict=True)

    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    sizes = [(61, 97), None, (130, 45)]
    records = [chat_record(f"s{i}", "Where is it?", "left", None if size is None else random_png(*size, i))
               for i, size in enumerate(sizes)]
    batch = process.pack([process(r) for r in records])
    with torch.no_grad():
        ours = model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"],
                     media=batch["media"]).split(batch["cu_seqlens"].diff().tolist())

    vision = config.encoder_configs["image"]
    images = Qwen2VLImageProcessorPil(min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)
    for i, (size, got) in enumerate(zip(sizes, ours)):
        ids = batch["input_ids"][batch["cu_seqlens"][i]:batch["cu_seqlens"][i + 1]]
        kwargs = {"mm_token_type_ids": token_types(ids, config.image_token_id, config.video_token_id)[None]}
        if size is not None:
            pixels = images(images=[Image.open(io.BytesIO(random_png(*size, i)))], return_tensors="pt")
            kwargs.update(pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"])
        with torch.no_grad():
            want = reference(input_ids=ids[None], **kwargs).logits[0]
        assert_parity(got, want, f"sample {i} logits")
