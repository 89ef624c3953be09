"""The chat SFT builder: deterministic, disjoint splits whose answers are what the system prompt asks
of the user's digits, manifests with both baselines, a chat tokenizer loadable offline with the
ChatML tokens and template, and a cached second call."""

from __future__ import annotations

import json

from tests.chat_utils import chat_builder
from veomni.data.chat.text_dataset import read_conversations
from veomni.data.text.packed import load_tokenizer


def _build(root, capsys, train=300, held_out=60) -> str:
    """The builder's command line, run in this process (what ``data.prepare`` runs); its report."""
    chat_builder().main(["--train-out", str(root / "train"), "--eval-out", str(root / "eval"),
                         "--train-samples", str(train), "--eval-samples", str(held_out)])
    return capsys.readouterr().out


def _check_answer(messages: list[dict]) -> None:
    system, *turns = messages
    assert system["role"] == "system" and len(turns) in (2, 4)
    for user, assistant in zip(turns[::2], turns[1::2]):
        digits = user["content"].split()
        assert user["role"] == "user" and assistant["role"] == "assistant" and 3 <= len(digits) <= 6
        want = digits[::-1] if system["content"].startswith("Reverse") else sorted(digits)
        assert assistant["content"] == " ".join(want)


def test_builder_writes_correct_disjoint_splits_baselines_and_a_chat_tokenizer(tmp_path, capsys):
    report = _build(tmp_path / "a", capsys)
    _build(tmp_path / "b", capsys)
    assert "echo baseline" in report and "ChatML chat template" in report
    assert "cached" in _build(tmp_path / "a", capsys)
    splits = {}
    for split, count in (("train", 300), ("eval", 60)):
        a = list(read_conversations(str(tmp_path / "a" / split)))
        assert a == list(read_conversations(str(tmp_path / "b" / split))) and len(a) == count
        for _, messages in a:
            _check_answer(messages)
        splits[split] = {key for key, _ in a}
    assert not splits["train"] & splits["eval"]
    manifest = json.loads((tmp_path / "a" / "eval" / "manifest.json").read_text())
    assert set(manifest["majority_baseline"]) == set(manifest["echo_baseline"]) == {"reverse", "sort"}
    tokenizer = load_tokenizer(str(tmp_path / "a" / "tokenizer"))
    assert len(tokenizer) == 8194 and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [8192, 8193]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1 2"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<|im_start|>user\n1 2<|im_end|>\n<|im_start|>assistant\n"
