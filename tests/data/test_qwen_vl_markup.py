"""``data.chat_markup: model`` under a ``qwen2_5_vl`` model writes Qwen's own chat markup: a two-turn
conversation with an image gives the token ids of Qwen's published chat template (ChatML with the
default system turn), written out by hand below and tokenized whole by the bundled tokenizer, with
loss targets on the answers and their ``<|im_end|>`` only; the markup's tokens are checked against
the config's ids like the vision tokens, and a family without a markup is refused by the launch check."""

from __future__ import annotations

import io
import json

import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from tests.omni_utils import TINY_OMNI, TINY_QWEN_VL_CHAT, TOKENIZER, random_png, write_shard
from veomni.config.schema import DataConfig
from veomni.contract import build_config
from veomni.data.chat.media_dataset import SampleProcessor, check_chat_media_data
from veomni.data.text.packed import load_tokenizer

# the bundled tokenizer's 8192 tokens, Qwen's four vision tokens, then the markup's two
CHATML_IDS = dict(im_start_token_id=8196, im_end_token_id=8197)
MESSAGES = [{"role": "user", "content": "<image>\nWhat color is it?"}, {"role": "assistant", "content": "red"},
            {"role": "user", "content": "And the shape?"}, {"role": "assistant", "content": "a circle"}]


def _record(messages) -> dict:
    return {"__key__": "two_turns", "json": json.dumps({"messages": messages}).encode(), "png": random_png(61, 97, 3)}


def _processor(**overrides) -> SampleProcessor:
    config = build_config("qwen2_5_vl", {**TINY_QWEN_VL_CHAT, **CHATML_IDS, **overrides})
    return SampleProcessor(load_tokenizer(str(TOKENIZER)), config, markup="model")


def _image_tokens() -> int:
    """Merged tokens of the record's image by transformers' image processor."""
    vision = build_config("qwen2_5_vl", TINY_QWEN_VL_CHAT).encoder_configs["image"]
    images = Qwen2VLImageProcessorPil(min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)
    grid = images(images=[Image.open(io.BytesIO(random_png(61, 97, 3)))], return_tensors="pt")["image_grid_thw"]
    return int(grid.prod()) // 4


def test_two_turns_with_an_image_are_qwens_chat_template():
    process = _processor()
    sample = process(_record(MESSAGES))
    tokenizer = process.chat.tokenizer
    # Qwen2.5-VL's chat_template.json for string contents: a default system turn, then
    # "<|im_start|>{role}\n{content}<|im_end|>\n" per turn; the image as <|vision_start|> pads <|vision_end|>
    image = "<|vision_start|>" + "<|image_pad|>" * _image_tokens() + "<|vision_end|>"
    text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\n{image}\nWhat color is it?<|im_end|>\n"
            "<|im_start|>assistant\nred<|im_end|>\n"
            "<|im_start|>user\nAnd the shape?<|im_end|>\n"
            "<|im_start|>assistant\na circle<|im_end|>\n")
    assert sample.chat.ids == tokenizer.encode(text, add_special_tokens=False)
    targets = [i for i, target in zip(sample.chat.ids, sample.chat.targets) if target]
    assert targets == tokenizer.encode("red<|im_end|>a circle<|im_end|>", add_special_tokens=False)
    assert tokenizer.convert_ids_to_tokens([8196, 8197]) == ["<|im_start|>", "<|im_end|>"]
    assert process.chat.answer_end == [8197]  # where the VQA eval stops a generated answer

    prompt = process(_record(MESSAGES), add_generation_prompt=True)  # the last answer left to the model
    head = text[:text.rindex("a circle")]
    assert prompt.chat.ids == tokenizer.encode(head, add_special_tokens=False)

    own = [{"role": "system", "content": "Be brief."}, *MESSAGES[:2]]  # its own system turn replaces the default
    head = tokenizer.encode("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n", add_special_tokens=False)
    assert process(_record(own)).chat.ids[:len(head)] == head


def test_markup_tokens_with_other_ids_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"gives <\|im_end\|> id 8197, the model config expects 151645"):
        _processor(im_end_token_id=151645)
    write_shard(tmp_path / "train" / "shard-000000.tar", [_record(MESSAGES)])
    cfg = DataConfig(train_path=str(tmp_path / "train"), tokenizer=str(TOKENIZER), chat_markup="model")
    assert check_chat_media_data(cfg, build_config("qwen2_5_vl", {**TINY_QWEN_VL_CHAT, **CHATML_IDS})) == []
    problems = check_chat_media_data(cfg, build_config("qwen2_5_vl", TINY_QWEN_VL_CHAT))
    assert any("<|im_start|> id 8196, the model config expects 151644" in p for p in problems), problems
    problems = check_chat_media_data(cfg, build_config("omni", TINY_OMNI))
    assert problems == ["data.chat_markup='model': expected 'plain', or 'model' for a model family that declares "
                        "its chat markup (OmniConfig declares none)"]
