"""A trained run answers through ``RunChat`` and ``scripts/chat.sh``: its checkpoint, its tokenizer's
chat template and stop tokens, one answer per line read. The model is made to say "7"
whatever it reads, so every answer is known exactly."""

from __future__ import annotations

import io

import pytest
import torch.distributed.checkpoint as dcp
import yaml

from harness.media_bytes import png_bytes
from tests.chat_utils import VOCAB, write_chat_tokenizer
from tests.omni_utils import REPO, TOKENIZER
from tests.parity_utils import TINY_LLM, tiny_model
from tests.recipes.test_chat_eval import _always_says
from tests.recipes.test_vqa_eval import _run_dir as vqa_run_dir
from veomni.checkpoint.manager import COMPLETE_MARKER
from veomni.data.builders import load_script
from veomni.data.text.packed import load_tokenizer
from veomni.errors import BadConfig
from veomni.generation import SamplingParams
from veomni.inference import RunChat


def _run(tmp_path, token_text: str = "7"):
    tokenizer_dir = write_chat_tokenizer(tmp_path / "tokenizer")
    tokenizer = load_tokenizer(str(tokenizer_dir))
    (token,) = tokenizer.encode(token_text, add_special_tokens=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "model": {"arch": "llm", **TINY_LLM, "vocab_size": VOCAB, "tie_embeddings": False},
        "data": {"kind": "chat_text", "train_path": str(tmp_path / "train.jsonl"), "tokenizer": str(tokenizer_dir),
                 "max_seq_len": 64, "tokens_per_micro_batch": 128}}))
    model = tiny_model(vocab_size=VOCAB, tie_embeddings=False)
    _always_says(model, token)
    step = run / "checkpoints" / "step_00000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step))
    (step / COMPLETE_MARKER).write_text("{}")
    return run, tokenizer, token


def test_a_run_answers_text_and_conversations(tmp_path) -> None:
    run, tokenizer, seven = _run(tmp_path)
    chat = RunChat(run)
    three = SamplingParams(max_new_tokens=3)
    want = tokenizer.decode([seven] * 3, skip_special_tokens=True)
    assert chat.reply([{"role": "user", "content": "2 5"}], three) == want.strip()
    assert chat.complete("1 2", SamplingParams(max_new_tokens=3)) == want
    assert chat.stop and tokenizer.eos_token_id in chat.stop


def test_chat_command_answers_each_line_until_an_empty_one(tmp_path) -> None:
    run, tokenizer, seven = _run(tmp_path)
    script = load_script(REPO / "scripts" / "chat.py")
    out = io.StringIO()
    assert script.main([str(run), "--max-new-tokens", "2"], io.StringIO("1 2\n3\n/reset\n4\n\nnot read\n"), out) == 0
    assert out.getvalue().splitlines() == [tokenizer.decode([seven] * 2, skip_special_tokens=True).strip()] * 3


def test_a_vision_language_run_answers_about_an_image(tmp_path) -> None:
    """An omni run (image encoder + LLM) made to say "red": ``RunChat.reply`` reads the image member
    with the conversation's ``<image>`` marker; a model without encoders refuses media by name."""
    tokenizer = load_tokenizer(str(TOKENIZER))
    (red,) = tokenizer.encode("red", add_special_tokens=False)
    chat = RunChat(vqa_run_dir(tmp_path, "red", red))
    question = [{"role": "user", "content": "<image>\nWhat color is the shape?"}]
    assert chat.reply(question, SamplingParams(max_new_tokens=2), media={"png": png_bytes(0)}) == "redred"
    text_run, _, _ = _run(tmp_path / "text")
    with pytest.raises(BadConfig, match="no media encoders: it cannot read \\['png'\\]"):
        RunChat(text_run).reply(question, media={"png": png_bytes(0)})
