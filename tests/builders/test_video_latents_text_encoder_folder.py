"""The latent precompute's ``--text-encoder`` folder: a transformers umT5 folder (``config.json``,
no ``manifest.json``, as a real Wan text encoder is saved) is read as it is, never rebuilt over;
a folder that is not one is refused naming what is missing."""

from __future__ import annotations

import pytest
from transformers import UMT5Config, UMT5EncoderModel

from tests.builders.test_video_latents_builder import DATA
from tests.video_utils import WORDS, save_tokenizer
from veomni.data.builders import load_script
from veomni.data.video.encoders import EncoderError

WIDTH = 48  # not the tiny built encoder's 64: the folder must be read, not replaced


def _save_umt5(folder) -> None:
    UMT5EncoderModel(UMT5Config(vocab_size=len(WORDS) + 2, d_model=WIDTH, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                                relative_attention_num_buckets=8)).save_pretrained(folder)


def test_a_transformers_umt5_folder_without_a_manifest_is_read_as_it_is(tmp_path):
    folder = tmp_path / "umt5"
    _save_umt5(folder)
    save_tokenizer(folder)
    files = {p.name: p.read_bytes() for p in folder.iterdir()}
    encoder = load_script(DATA / "build_video_latents.py").load_text_encoder(folder, tmp_path / "no_clips")
    assert encoder.encoder.config.d_model == WIDTH
    assert encoder.encode(["a red circle moves left"])[0].shape == (5, WIDTH)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == files  # nothing built over it


def test_a_folder_that_is_not_a_text_encoder_is_refused_naming_what_is_missing(tmp_path):
    builder = load_script(DATA / "build_video_latents.py")
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "model.safetensors").write_bytes(b"")
    with pytest.raises(EncoderError, match="no config.json"):
        builder.load_text_encoder(tmp_path / "weights", tmp_path / "no_clips")
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["model.safetensors"]
    _save_umt5(tmp_path / "no_tokenizer")
    with pytest.raises(EncoderError, match="no tokenizer"):
        builder.load_text_encoder(tmp_path / "no_tokenizer", tmp_path / "no_clips")
