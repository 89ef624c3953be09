"""The VQA eval's answer-length cap: greedy decoding stops after ``max_tokens``, and
``--max-answer-tokens`` of ``python -m veomni.eval.vqa`` reaches that decode."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml

from harness.media_bytes import png_bytes
from tests.omni_utils import TINY_OMNI, TOKENIZER, chat_record, tiny_omni, write_shard
from veomni.checkpoint.manager import COMPLETE_MARKER
from veomni.data.chat.media_dataset import SampleProcessor
from veomni.data.text.packed import load_tokenizer
from veomni.eval.vqa import greedy_answers, main

UNTIED = {**TINY_OMNI, "llm": {**TINY_OMNI["llm"], "tie_embeddings": False}}


def test_greedy_answers_stop_after_max_tokens():
    config, model = tiny_omni()
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    records = [chat_record("a", "What color?", "red", png_bytes(1)), chat_record("b", "Plain question", "no")]
    prompts = [process(record, add_generation_prompt=True) for record in records]
    two = greedy_answers(model.eval(), prompts, eos_id=-1, max_tokens=2)  # eos -1: no token ends an answer
    three = greedy_answers(model, prompts, eos_id=-1, max_tokens=3)
    assert [len(a) for a in two] == [2, 2] and [len(a) for a in three] == [3, 3]
    assert [a[:2] for a in three] == two  # greedy: a longer cap extends the same answers


def _always_says(model: torch.nn.Module, token: int) -> None:
    """Make the omni model's argmax ``token`` at every position: the blocks add nothing to the
    residual stream, every token embeds as the first unit vector, and only ``token``'s head row
    reads that dimension."""
    with torch.no_grad():
        for name, param in model.llm.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        model.llm.norm.weight.fill_(1.0)
        model.llm.embed_tokens.weight.zero_()[:, 0] = 1.0
        model.llm.lm_head.weight.zero_()[token, 0] = 1.0


def _run_dir(tmp_path, answer: str, token: int):
    """A run folder as training leaves it: config.yaml, a complete checkpoint, train and eval shards."""
    records = [chat_record(f"q{i}", "What color is the shape?", answer, png_bytes(i)) for i in range(3)]
    for split in ("train", "eval"):
        write_shard(tmp_path / split / "shard-000000.tar", records)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "model": {"arch": "omni", **UNTIED},
        "data": {"train_path": str(tmp_path / "train"), "eval_path": str(tmp_path / "eval"),
                 "tokenizer": str(TOKENIZER), "text_key": "json"},
    }))
    _, model = tiny_omni(**UNTIED)
    _always_says(model, token)
    step = run / "checkpoints" / "step_00000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step))
    (step / COMPLETE_MARKER).write_text("{}")
    return run


def _accuracy(run, tmp_path, *flags: str) -> float:
    out = tmp_path / "result.json"
    assert main([str(run), "--json", str(out), *flags]) == 0
    return json.loads(out.read_text())["all"]["accuracy"]


def test_max_answer_tokens_flag_reaches_the_decode(tmp_path):
    tokenizer = load_tokenizer(str(TOKENIZER))
    (red,) = tokenizer.encode("red", add_special_tokens=False)
    run = _run_dir(tmp_path, "red", red)  # the model answers "red", "redred", ... up to the cap
    assert _accuracy(run, tmp_path, "--max-answer-tokens", "1") == 1.0
    assert _accuracy(run, tmp_path, "--max-answer-tokens", "2") == 0.0
    assert _accuracy(run, tmp_path) == 0.0  # the default cap (8) decodes "red" eight times
    with pytest.raises(SystemExit):
        main([str(run), "--max-answer-tokens", "0"])
