"""The launcher checks every record of a chat jsonl before any worker starts (``veomni/data/chat/record_check.py``),
dry run and real run alike, naming the file, the line and why: a turn without ``role``, an unknown role,
an empty content, ``messages`` that is not a list, a line that is not JSON (``chat_text``: refused above
``data.max_bad_fraction``, named as a warning below it); a media file a record names that does not
exist (``chat_media``: file, line and path), and a media record whose layout a worker would stop on."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from tests.chat_utils import CONVERSATIONS, VOCAB, openai_line, write_chat_tokenizer
from tests.config.test_bad_recipes import launch_both_modes
from tests.omni_utils import TINY_QWEN_VL_CHAT, TOKENIZER, random_png

GOOD = [openai_line(m) for m in CONVERSATIONS * 4]  # 20 records
BAD_TEXT = [
    ("no-role", json.dumps({"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}),
     r"turn 0 has no 'role'"),
    ("unknown-role", json.dumps({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant",
                                                                                     "content": "yo"}]}),
     r"turn 0 has the unknown role 'robot'"),
    ("empty-content", json.dumps({"messages": [{"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": " "}]}),
     r"turn 1 \(assistant\) has an empty 'content'"),
    ("not-a-list", json.dumps({"messages": {"role": "user", "content": "hi"}}),
     r"expected an object with a 'messages' list"),
    ("not-json", "{'messages': []}", r"not a utf-8 JSON object"),
]


def _text_recipe(tmp_path) -> str:
    recipe = {
        "model": {"arch": "llm", "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_layers": 2,
                  "num_heads": 4, "num_kv_heads": 2, "head_dim": 8, "max_position_embeddings": 256},
        "data": {"kind": "chat_text", "train_path": "chat.jsonl", "tokenizer": str(tmp_path / "tokenizer"),
                 "max_seq_len": 128, "tokens_per_micro_batch": 256},
        "train": {"output_dir": "out", "max_steps": 1},
    }
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    return str(tmp_path / "r.yaml")


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    return write_chat_tokenizer(tmp_path_factory.mktemp("chat") / "tokenizer")


@pytest.mark.parametrize("case, line, why", BAD_TEXT, ids=[case[0] for case in BAD_TEXT])
def test_a_bad_chat_record_is_named_by_file_and_line_before_workers(tmp_path, chat_tokenizer, case, line, why,
                                                                   monkeypatch, capsys):
    (tmp_path / "tokenizer").symlink_to(chat_tokenizer)
    (tmp_path / "chat.jsonl").write_text("\n".join([*GOOD[:7], line, *GOOD[7:]]) + "\n")
    monkeypatch.chdir(tmp_path)
    recipe = _text_recipe(tmp_path)
    results = launch_both_modes(recipe, [], capsys)
    for status, output in results:
        assert status == 2, output
        assert "1 of 21 chat records are bad (4.8% > data.max_bad_fraction 1.0%)" in output, output
        assert f"\n  {tmp_path}/chat.jsonl:8: " in output and re.search(why, output), output
    assert results[0][1] == results[1][1]
    status, output = launch_both_modes(recipe, ["--data.max_bad_fraction", "0.1"], capsys)[1]
    assert status == 0 and "1 of 21 chat records are bad and will be skipped and counted" in output, output


def _media_recipe(tmp_path) -> str:
    recipe = {"model": {"arch": "qwen2_5_vl", **TINY_QWEN_VL_CHAT},
              "data": {"train_path": "set/chat.jsonl", "tokenizer": str(TOKENIZER), "max_seq_len": 256,
                       "tokens_per_micro_batch": 512},
              "train": {"output_dir": "out", "max_steps": 1}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    return str(tmp_path / "r.yaml")


def _media_line(image: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "<image>Where?"},
                                    {"role": "assistant", "content": "left"}], "images": [image]})


def test_a_missing_media_file_is_named_by_file_line_and_path(tmp_path, monkeypatch, capsys):
    (tmp_path / "set" / "img").mkdir(parents=True)
    (tmp_path / "set" / "img" / "a.png").write_bytes(random_png(30, 30, 0))
    lines = [_media_line("img/a.png")] * 5 + [_media_line("img/missing.png")]
    (tmp_path / "set" / "chat.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    for status, output in launch_both_modes(_media_recipe(tmp_path), [], capsys):
        assert status == 2, output
        assert f"{tmp_path}/set/chat.jsonl:6: image file not found: {tmp_path}/set/img/missing.png" in output, output


def test_a_media_record_a_worker_would_stop_on_is_refused_whatever_the_fraction(tmp_path, monkeypatch, capsys):
    (tmp_path / "set" / "img").mkdir(parents=True)
    (tmp_path / "set" / "img" / "a.png").write_bytes(random_png(30, 30, 0))
    lines = [_media_line("img/a.png")] * 5 + [_media_line("img/a.gif")]
    (tmp_path / "set" / "chat.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path)
    for status, output in launch_both_modes(_media_recipe(tmp_path), ["--data.max_bad_fraction", "0.5"], capsys):
        assert status == 2, output
        assert "1 chat record(s) a worker would stop the run on" in output
        assert "chat.jsonl:6: image file 'img/a.gif' has none of the extensions" in output, output
