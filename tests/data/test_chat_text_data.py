"""The chat_text kind: loss only on assistant turns (checked against transformers' own
``return_assistant_tokens_mask`` on a template with ``{% generation %}`` markers), conversations
packed without crossing, OpenAI / ShareGPT / webdataset inputs giving identical rows, bad records
counted instead of fatal, a tokenizer without a template refused at start-up, whole-turn
truncation, and exact resume."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.chat_utils import (
    CONVERSATIONS,
    REPO,
    VOCAB,
    chat_loader,
    openai_line,
    sharegpt_line,
    write_chat_shard,
    write_chat_tokenizer,
    write_jsonl,
)
from veomni.config.schema import DataConfig
from veomni.data.kinds import get_dataset_kind
from veomni.data.sources import BadDataError
from veomni.data.text.packed import load_tokenizer
from veomni.tasks.base import IGNORE_INDEX

BASE = str(REPO / "data" / "tokenizers" / "stdlib-bpe-8k")


class _Model:
    vocab_size = VOCAB


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat") / "tokenizer")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(str(tokenizer_dir))


def _rows(path, tokenizer_dir, **overrides) -> list[dict]:
    return list(chat_loader(path, tokenizer_dir, **overrides))


def _samples(batch: dict) -> list[tuple[list[int], list[bool]]]:
    """Per packed sample: its ids, and which of its tokens a label predicts (a loss target)."""
    ids, labels, bounds = batch["input_ids"], batch["labels"], batch["cu_seqlens"].tolist()
    out = []
    for a, b in zip(bounds, bounds[1:]):
        predicted = [False] + (labels[a:b - 1] != IGNORE_INDEX).tolist()
        out.append((ids[a:b].tolist(), predicted))
    return out


def test_loss_only_on_assistant_turns_as_transformers_marks_them(tmp_path, tokenizer_dir, tokenizer):
    rows = _rows(write_jsonl(tmp_path / "c.jsonl", [openai_line(m) for m in CONVERSATIONS]), tokenizer_dir)
    samples = [s for row in rows for s in _samples(row)]
    assert len(samples) == len(CONVERSATIONS)
    for (ids, predicted), messages in zip(samples, CONVERSATIONS):
        reference = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                  return_assistant_tokens_mask=True)
        assert ids == list(reference["input_ids"])
        assert predicted == [bool(m) for m in reference["assistant_masks"]]
        answers = "".join(m["content"] + "<|im_end|>\n" for m in messages if m["role"] == "assistant")
        assert tokenizer.decode([t for t, p in zip(ids, predicted) if p]) == answers
    for row in rows:  # every kept label is the next token of its own sample
        kept = (row["labels"] != IGNORE_INDEX).nonzero().flatten()
        assert torch.equal(row["labels"][kept], row["input_ids"][kept + 1])


def test_conversations_share_rows_without_crossing(tmp_path, tokenizer_dir, tokenizer):
    lines = [openai_line(m) for m in CONVERSATIONS] * 3
    rows = _rows(write_jsonl(tmp_path / "c.jsonl", lines), tokenizer_dir, tokens_per_micro_batch=200,
                 max_seq_len=200)
    assert len(rows) > 1 and max(row["num_samples"] for row in rows) > 1
    alone = [tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"] for m in CONVERSATIONS]
    assert [ids for row in rows for ids, _ in _samples(row)] == [list(ids) for ids in alone] * 3
    for row in rows:
        bounds = row["cu_seqlens"].tolist()
        assert row["input_ids"].numel() <= 200 and bounds[-1] == row["input_ids"].numel()
        assert all(row["labels"][b - 1] == IGNORE_INDEX for b in bounds[1:])  # no label predicts the next sample
        for a, b in zip(bounds, bounds[1:]):
            assert row["position_ids"][a:b].tolist() == list(range(b - a))


def test_openai_sharegpt_and_webdataset_inputs_give_identical_rows(tmp_path, tokenizer_dir):
    openai = [openai_line(m) for m in CONVERSATIONS]
    sources = [write_jsonl(tmp_path / "openai.jsonl", openai),
               write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt_line(m) for m in CONVERSATIONS]),
               write_chat_shard(tmp_path / "wds" / "shard-000000.tar", openai).parent,
               write_chat_shard(tmp_path / "wds_sharegpt" / "shard-000000.tar",
                                [sharegpt_line(m) for m in CONVERSATIONS]).parent]
    first, *others = [_rows(path, tokenizer_dir, tokens_per_micro_batch=300) for path in sources]
    assert sum(row["num_samples"] for row in first) == len(CONVERSATIONS)
    for rows in others:
        assert len(rows) == len(first)
        for got, want in zip(rows, first):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) if isinstance(want[k], torch.Tensor) else got[k] == want[k]
                       for k in want)


BAD = {
    "missing role": {"messages": [{"content": "hi"}, {"role": "assistant", "content": "hello"}]},
    "unknown role": {"messages": [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]},
    "unknown ShareGPT speaker": {"conversations": [{"from": "bot", "value": "x"}, {"from": "gpt", "value": "y"}]},
    "no assistant turn": {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
    "content not a string": {"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}]},
    "neither layout": {"text": "plain"},
}


def test_bad_records_are_counted_and_skipped(tmp_path, tokenizer_dir, caplog):
    good = [openai_line(m) for m in CONVERSATIONS]
    lines = good[:2] + [json.dumps(v) for v in BAD.values()] + ["{broken json"] + good[2:]
    loader = chat_loader(write_jsonl(tmp_path / "c.jsonl", lines), tokenizer_dir, max_bad_fraction=0.9)
    with caplog.at_level(logging.WARNING):
        rows = list(loader)
    assert sum(row["num_samples"] for row in rows) == len(good)
    assert loader.dataset.state_dict()["sources"]["eval"]["bad_prior_epochs"] == len(BAD) + 1
    for why in ("has no 'role'", "unknown role 'tool'", "unknown from 'bot'", "no assistant turn",
                "needs a string 'content'", "'messages' list", "not a utf-8 JSON object"):
        assert why in caplog.text


def test_a_webdataset_sample_without_the_member_is_bad(tmp_path, tokenizer_dir):
    shard = write_chat_shard(tmp_path / "wds" / "shard-000000.tar", [openai_line(m) for m in CONVERSATIONS])
    with pytest.raises(BadDataError, match=f"{len(CONVERSATIONS)} of {len(CONVERSATIONS)} records were bad"):
        list(chat_loader(shard.parent, tokenizer_dir, text_key="txt", max_bad_fraction=0.5))


def test_a_tokenizer_without_chat_template_is_refused_at_start_up_naming_its_folder(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [openai_line(CONVERSATIONS[0])])
    cfg = DataConfig(kind="chat_text", train_path=str(path), tokenizer=BASE, text_key="json")
    problems = get_dataset_kind("chat_text").check(cfg, _Model())
    assert len(problems) == 1 and BASE in problems[0] and "no chat template" in problems[0]
    assert "tokenizer_config.json" in problems[0] and "chat_template" in problems[0]
    with pytest.raises(ValueError, match="no chat template"):
        chat_loader(path, BASE)


def test_the_bundled_chat_tokenizer_passes_the_start_up_check(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "c.jsonl", [openai_line(CONVERSATIONS[0])])
    cfg = DataConfig(kind="chat_text", train_path=str(path), tokenizer=str(tokenizer_dir), text_key="json")
    assert get_dataset_kind("chat_text").check(cfg, _Model()) == []


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path, tokenizer_dir, caplog):
    """A template that marks the last message (as reasoning templates drop earlier thoughts) renders a
    prefix differently: the launcher's probe refuses it, and a worker counts such samples as bad."""
    tokenizer = load_tokenizer(str(tokenizer_dir))
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                               "{% if loop.last %} (last){% endif %}<|im_end|>\n{% endfor %}"
                               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    folder = tmp_path / "rewriting"
    tokenizer.save_pretrained(str(folder))
    path = write_jsonl(tmp_path / "c.jsonl", [openai_line(m) for m in CONVERSATIONS])
    cfg = DataConfig(kind="chat_text", train_path=str(path), tokenizer=str(folder), text_key="json")
    (problem,) = get_dataset_kind("chat_text").check(cfg, _Model())
    assert "renders the conversation" in problem and "differently" in problem
    with caplog.at_level(logging.WARNING), pytest.raises(BadDataError, match="5 of 5 records were bad"):
        list(chat_loader(path, folder, max_bad_fraction=0.5))
    assert "differently from the whole conversation (from character" in caplog.text


def test_long_conversations_keep_whole_turns_that_fit(tmp_path, tokenizer_dir, tokenizer, caplog):
    messages = CONVERSATIONS[4]  # three exchanges
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    two = tokenizer.apply_chat_template(messages[:5], tokenize=True, return_dict=True)["input_ids"]
    one = tokenizer.apply_chat_template(messages[:3], tokenize=True, return_dict=True)["input_ids"]
    path = write_jsonl(tmp_path / "c.jsonl", [openai_line(messages)])
    (row,) = _rows(path, tokenizer_dir, max_seq_len=len(full) - 1)
    assert row["input_ids"].tolist() == list(two)  # cut after the second answer, not inside the third turn
    (row,) = _rows(path, tokenizer_dir, max_seq_len=len(two) - 1)
    assert row["input_ids"].tolist() == list(one)
    loader = chat_loader(path, tokenizer_dir, max_seq_len=len(one) - 1, max_bad_fraction=1.0)
    with caplog.at_level(logging.WARNING):
        assert list(loader) == []
    assert "past data.max_seq_len" in caplog.text


def test_resume_continues_with_the_next_batch(tmp_path, tokenizer_dir):
    lines = [openai_line(m, id=f"conv{i}") for i, m in enumerate(CONVERSATIONS * 8)]
    path = write_chat_shard(tmp_path / "wds" / "shard-000000.tar", lines).parent
    loader = chat_loader(path, tokenizer_dir, split="train", tokens_per_micro_batch=300, shuffle_window=8)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    expected = [next(it) for _ in range(4)]
    resumed = chat_loader(path, tokenizer_dir, split="train", tokens_per_micro_batch=300, shuffle_window=8)
    resumed.load_state_dict(state)
    for want, got in zip(expected, iter(resumed)):
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["labels"], want["labels"])
