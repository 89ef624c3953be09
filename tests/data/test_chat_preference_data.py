"""The ``chat_preference`` kind: TRL-style conversational pairs rendered with the chat template,
targets on the replies only, the two halves of a pair adjacent in one micro-batch through packing
and resume, and malformed or oversized pairs refused at launch naming file and record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.chat_utils import write_chat_shard, write_chat_tokenizer, write_jsonl
from veomni.config.schema import DataConfig
from veomni.data.build_loader import build_dataloader
from veomni.data.chat.preference_dataset import preference_problems
from veomni.data.text.packed import load_tokenizer
from veomni.tasks.base import IGNORE_INDEX


def _msg(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


def pair(i: int, **override) -> dict:
    digits = " ".join(str((i * 7 + k) % 10) for k in range(3 + i % 4))
    record = {"id": f"p{i}",
              "prompt": [_msg("system", "Sort the digits."), _msg("user", digits)],
              "chosen": [_msg("assistant", " ".join(sorted(digits.split())))],
              "rejected": [_msg("assistant", digits + (" 0" * (i % 3)))]}
    if i % 5 == 1:  # a multi-turn prompt: its earlier assistant turn is context, not a target
        record["prompt"] = [_msg("user", "1 2"), _msg("assistant", "1 2"), *record["prompt"][1:]]
    return {**record, **override}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return write_chat_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


def _cfg(path: Path, tokenizer: Path, **overrides) -> DataConfig:
    return DataConfig(kind="chat_preference", train_path=str(path), tokenizer=str(tokenizer),
                      **{"text_key": "json", "max_seq_len": 64, "tokens_per_micro_batch": 200, **overrides})


def _loader(cfg: DataConfig, tokenizer: Path, split: str = "train"):
    return build_dataloader(cfg, split, load_tokenizer(str(tokenizer)), 0, 1, 0, None, kind="chat_preference")


def _halves(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    bounds = batch["cu_seqlens"].tolist()
    return [(batch["input_ids"][a:b], batch["labels"][a:b]) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("fmt", ["jsonl", "webdataset"])
def test_pairs_pack_adjacent_with_targets_on_the_replies_only(fmt: str, tmp_path: Path, tokenizer: Path) -> None:
    records = [json.dumps(pair(i)) for i in range(12)]
    path = write_jsonl(tmp_path / "pairs.jsonl", records) if fmt == "jsonl" else \
        write_chat_shard(tmp_path / "shards" / "shard-000000.tar", records).parent
    tok = load_tokenizer(str(tokenizer))
    seen = 0
    for batch in _loader(_cfg(path, tokenizer, eval_path=str(path)), tokenizer, "eval"):
        halves = _halves(batch)
        assert len(halves) % 2 == 0 and batch["input_ids"].numel() <= 200
        for (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) in zip(halves[0::2], halves[1::2]):
            record = pair(seen)
            seen += 1
            for labels, name in ((chosen_labels, "chosen"), (rejected_labels,
                                                             "rejected")):
                targets = tok.decode(labels[labels != IGNORE_INDEX].tolist())
                assert targets == record[name][0]["content"] + "<|im_end|>\n", (seen, name, targets)
            first_target = int((chosen_labels != IGNORE_INDEX).nonzero()[0])
            assert torch.equal(chosen_ids[:first_target + 1], rejected_ids[:first_target + 1]), "one prompt"
    assert seen == 12


def test_resume_continues_with_whole_pairs(tmp_path: Path, tokenizer: Path) -> None:
    path = write_jsonl(tmp_path / "pairs.jsonl", [json.dumps(pair(i)) for i in range(30)])
    cfg = _cfg(path, tokenizer, tokens_per_micro_batch=120)
    whole = _loader(cfg, tokenizer)
    it = iter(whole)
    [next(it) for _ in range(3)]
    state = whole.state_dict()
    expected = [next(it) for _ in range(3)]
    resumed = _loader(cfg, tokenizer)
    resumed.load_state_dict(state)
    got = [b for _, b in zip(range(3), resumed)]
    for a, b in zip(expected, got):
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["cu_seqlens"], b["cu_seqlens"])
        assert (len(a["cu_seqlens"]) - 1) % 2 == 0


def test_malformed_and_oversized_pairs_are_refused_naming_file_and_record(tmp_path: Path, tokenizer: Path) -> None:
    good = [json.dumps(pair(i)) for i in range(3)]
    bad = [json.dumps({k: v for k, v in pair(10).items() if k != "chosen"}),
           json.dumps(pair(11, rejected=[])),
           json.dumps(pair(12, rejected=[_msg("assistant", " ")])),
           json.dumps(pair(13, chosen=[_msg("user", "hi"), _msg("assistant", "1")])),
           "not json",
           json.dumps(pair(14, chosen=[_msg("assistant", " ".join("9" * 80))]))]
    path = write_jsonl(tmp_path / "pairs.jsonl", good + bad)
    problems = preference_problems(_cfg(path, tokenizer), load_tokenizer(str(tokenizer)))
    assert len(problems) == len(bad), problems
    expected = ["'chosen' is missing", "'rejected' is empty", "has an empty 'content'",
                "must start with the assistant's reply", "not a utf-8 JSON object", "over data.max_seq_len=64"]
    for line, (problem, words) in enumerate(zip(problems, expected), start=len(good) + 1):
        assert f"pairs.jsonl:{line}:" in problem and words in problem, problem
    tight = preference_problems(_cfg(path, tokenizer, tokens_per_micro_batch=40), load_tokenizer(str(tokenizer)))
    assert any("cannot fit a micro-batch of data.tokens_per_micro_batch=40" in p and "pairs.jsonl:1:" in p
               for p in tight), tight
    assert preference_problems(_cfg(write_jsonl(tmp_path / "ok.jsonl", good), tokenizer),
                               load_tokenizer(str(tokenizer))) == []


def test_the_greedy_eval_reads_each_pair_as_its_two_conversations(tmp_path: Path) -> None:
    from veomni.data.chat.preference_dataset import read_pair_conversations

    path = write_jsonl(tmp_path / "pairs.jsonl", [json.dumps(pair(0)), json.dumps(pair(1, chosen=[])),
                                                  json.dumps(pair(2))])
    read = list(read_pair_conversations(str(path)))
    assert [key for key, _, _ in read] == ["p0", "p2"]
    assert read[1][1] == [*pair(2)["prompt"], *pair(2)["chosen"]]
    assert read[1][2] == [*pair(2)["prompt"], *pair(2)["rejected"]]
