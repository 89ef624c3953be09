"""The audio modality plugged into the omni model through the registry alone: audio features land
on the <audio> placeholders in order next to images and text-only samples, a sample does not
depend on its packing neighbours, and the tiny audio-caption recipe trains end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harness.media_bytes import png_bytes, wav_bytes
from tests.launch.test_launch import REPO, train_sh
from tests.omni_utils import TINY_OMNI, TOKENIZER, chat_record, tiny_omni
from tests.parity_utils import assert_parity
from veomni.data.builders import load_script
from veomni.data.chat.media_dataset import SampleProcessor, pack_chat_samples
from veomni.data.text.packed import load_tokenizer
from veomni.eval.vqa import DEFAULT_MAX_ANSWER_TOKENS

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

AUDIO = dict(n_mels=16, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, out_hidden_size=32)
ENCODERS = {**TINY_OMNI["encoders"], "audio": AUDIO}


def audio_record(key: str, answer: str, seconds: float, seed: int) -> dict:
    meta = {"messages": [{"role": "user", "content": "<audio>\nDescribe the sound."},
                         {"role": "assistant", "content": answer}], "question_type": "tone"}
    return {"__key__": key, "json": json.dumps(meta).encode(), "wav": wav_bytes(seed, seconds)}


def _run(model, batch):
    return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"],
                 media=batch["media"])


def test_audio_features_replace_placeholders_next_to_images():
    config, model = tiny_omni(encoders=ENCODERS)
    records = [audio_record("a", "A low tone.", 0.5, 1),
               chat_record("b", "What color?", "red", png_bytes(1, 56, 84)),
               chat_record("c", "Plain text question", "no"),
               audio_record("d", "A high tone.", 0.33, 2)]
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    batch = pack_chat_samples([process(r) for r in records])
    seen = {}
    model.llm.layers[0].register_forward_pre_hook(lambda _m, args: seen.update(x=args[0].detach()))
    _run(model, batch)
    audio = batch["media"]["audio"]
    # 0.5 s = 51 frames -> 13 tokens, 0.33 s = 34 frames -> 9 tokens (stride 2 twice, rounding up)
    assert audio["inputs"]["lengths"].tolist() == [51, 34] and audio["positions"].numel() == 13 + 9
    expected = torch.cat([model.encoders["audio"](**process.media(r)["audio"][0].inputs) for r in (records[0],
                                                                                                   records[3])])
    assert_parity(seen["x"][audio["positions"]], expected.detach(), "seen['x'][audio['positions']]")
    assert batch["media"]["image"]["positions"].numel() == 6
    assert (batch["labels"][audio["positions"]] == -100).all()


def test_audio_sample_does_not_depend_on_packing_neighbours():
    config, model = tiny_omni(encoders=ENCODERS)
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    a, b = audio_record("a", "A low tone.", 0.5, 1), audio_record("b", "Two beeps.", 0.9, 3)
    alone = pack_chat_samples([process(a)])
    packed = pack_chat_samples([process(b), process(a)])
    start = int(packed["cu_seqlens"][1])
    assert_parity(_run(model, packed)[start:], _run(model, alone), "_run(model, packed)[start:]")


def test_every_caption_fits_the_greedy_eval():
    """The eval decodes at most DEFAULT_MAX_ANSWER_TOKENS tokens unless told otherwise: a longer caption
    could never match with the documented command."""
    tokenizer = load_tokenizer(str(TOKENIZER))
    captions = load_script(REPO / "data" / "build_audio_captions.py").possible_captions()
    lengths = {c: len(tokenizer.encode(c, add_special_tokens=False)) for c in captions}
    assert len(lengths) == 20 and max(lengths.values()) <= DEFAULT_MAX_ANSWER_TOKENS, lengths


@pytest.mark.parametrize("layout", [[], ["--parallel.sp", "2"]], ids=["dp2", "sp2"])
def test_audio_caption_recipe_trains_end_to_end(tmp_path, layout):
    builder = load_script(REPO / "data" / "build_audio_captions.py")
    builder.build(tmp_path / "train", tmp_path / "eval", seed=1, train_samples=48, eval_samples=8)
    result = train_sh(str(REPO / "recipes" / "audio" / "tiny_audio_caption.yaml"),
                      "--data.train_path", str(tmp_path / "train"),
                      "--data.eval_path", str(tmp_path / "eval"),
                      "--data.prepare", "null", "--train.max_steps", "2", "--train.eval_interval", "2",
                      "--train.eval_batches", "1", "--train.output_dir", str(tmp_path / "out"),
                      "--checkpoint.interval", "2", *layout)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in m for m in metrics)
    assert all(np.isfinite(m["loss"]) for m in metrics if "loss" in m)
