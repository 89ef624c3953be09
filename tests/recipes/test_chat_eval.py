"""The chat exact-match eval: its batched greedy decode gives the one-prompt-at-a-time decode of the
trainer's sampler, and ``python -m veomni.eval.chat_exact_match`` scores a checkpoint whose answers
are known exactly, next to the echo and majority baselines of its data."""

from __future__ import annotations

import json

import torch
import torch.distributed.checkpoint as dcp
import yaml

from tests.chat_utils import VOCAB, openai_line, write_chat_tokenizer, write_jsonl
from tests.parity_utils import TINY_LLM, tiny_model
from veomni.checkpoint.hf_io import save_hf_pretrained
from veomni.checkpoint.manager import COMPLETE_MARKER
from veomni.contract import build_model
from veomni.data.text.packed import load_tokenizer
from veomni.eval.chat_exact_match import greedy_answers, main
from veomni.train.generate import sample_tokens


def test_batched_greedy_answers_match_one_prompt_at_a_time():
    model = tiny_model(vocab_size=VOCAB).eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (5, 11, 3, 8)]
    stop = {7}
    got = greedy_answers(model, prompts, stop, max_tokens=6)
    for prompt, answer in zip(prompts, got):
        alone = sample_tokens(model, prompt, 6, eos_id=7, temperature=0.0)
        assert answer == [t for t in alone if t != 7]


def _always_says(model: torch.nn.Module, token: int) -> None:
    """Make the decoder's argmax ``token`` everywhere: the blocks add nothing to the residual stream,
    every token embeds as the first unit vector, and only ``token``'s head row reads it."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.zero_()
        model.norm.weight.fill_(1.0)
        model.embed_tokens.weight.zero_()[:, 0] = 1.0
        model.lm_head.weight.zero_()[token, 0] = 1.0


def _conversation(question: str, answer: str) -> str:
    return openai_line([{"role": "system", "content": "Reverse the list of digits."},
                        {"role": "user", "content": question}, {"role": "assistant", "content": answer}])


def test_eval_command_scores_known_answers_against_both_baselines(tmp_path):
    tokenizer_dir = write_chat_tokenizer(tmp_path / "tokenizer")
    (seven,) = load_tokenizer(str(tokenizer_dir)).encode("7", add_special_tokens=False)
    held_out = [("7", "7"), ("1 7", "7 1"), ("3", "3"), ("2 5", "5 2")]  # "7" is right once; echo twice
    write_jsonl(tmp_path / "eval.jsonl", [_conversation(q, a) for q, a in held_out])
    write_jsonl(tmp_path / "train.jsonl", [_conversation("2 5", "5 2")] * 3 + [_conversation("7", "7")])
    run = tmp_path / "run"
    run.mkdir()
    options = {**TINY_LLM, "vocab_size": VOCAB, "tie_embeddings": False}
    (run / "config.yaml").write_text(yaml.safe_dump({
        "model": {"arch": "llm", **options},
        "data": {"kind": "chat_text", "train_path": str(tmp_path / "train.jsonl"),
                 "eval_path": str(tmp_path / "eval.jsonl"), "tokenizer": str(tokenizer_dir), "text_key": "json",
                 "max_seq_len": 64, "tokens_per_micro_batch": 128},
    }))
    model = tiny_model(vocab_size=VOCAB, tie_embeddings=False)
    _always_says(model, seven)
    step = run / "checkpoints" / "step_00000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step))
    (step / COMPLETE_MARKER).write_text("{}")
    out = tmp_path / "result.json"
    assert main([str(run), "--max-answer-tokens", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result == {"conversations": 4, "accuracy": 0.25, "echo": 0.5, "majority": 0.25, "majority_answer": "5 2"}
    assert main([str(run), "--json", str(out)]) == 0  # "7 7 7 ...": no longer right
    assert json.loads(out.read_text())["accuracy"] == 0.0


def _pair(question: str, chosen: str, rejected: str) -> str:
    prompt = [{"role": "system", "content": "Reverse the list of digits."}, {"role": "user", "content": question}]
    return json.dumps({"prompt": prompt, "chosen": [{"role": "assistant", "content": chosen}],
                       "rejected": [{"role": "assistant", "content": rejected}]})


def test_eval_command_scores_a_preference_run_and_its_start_against_both_replies(tmp_path):
    """A chat_preference run: each greedy answer against the pair's chosen and rejected replies, for
    the run's checkpoint and for the model it started from (``checkpoint.init_from_hf``)."""
    tokenizer_dir = write_chat_tokenizer(tmp_path / "tokenizer")
    tokenizer = load_tokenizer(str(tokenizer_dir))
    (seven,), (three,) = (tokenizer.encode(d, add_special_tokens=False) for d in ("7", "3"))
    held_out = [("7", "7", "3"), ("1 2", "3", "7"), ("1 2", "7", "1"), ("1 2", "2", "3")]
    write_jsonl(tmp_path / "eval.jsonl", [_pair(*p) for p in held_out])
    write_jsonl(tmp_path / "train.jsonl", [_pair("4", "2", "4")] * 3 + [_pair("7", "7", "3")])
    options = {**TINY_LLM, "vocab_size": VOCAB, "tie_embeddings": False}
    start_model = tiny_model(vocab_size=VOCAB, tie_embeddings=False)
    _always_says(start_model, three)
    config, _ = build_model("llm", options)
    start = save_hf_pretrained("llm", config, start_model.state_dict(), tmp_path / "start")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({
        "model": {"arch": "llm", **options},
        "data": {"kind": "chat_preference", "train_path": str(tmp_path / "train.jsonl"),
                 "eval_path": str(tmp_path / "eval.jsonl"), "tokenizer": str(tokenizer_dir), "text_key": "json",
                 "max_seq_len": 64, "tokens_per_micro_batch": 256},
        "checkpoint": {"init_from_hf": str(start)},
    }))
    model = tiny_model(vocab_size=VOCAB, tie_embeddings=False)
    _always_says(model, seven)
    step = run / "checkpoints" / "step_00000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(step))
    (step / COMPLETE_MARKER).write_text("{}")
    out = tmp_path / "result.json"
    assert main([str(run), "--max-answer-tokens", "1", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {
        "conversations": 4, "accuracy": 0.5, "rejected": 0.25, "echo": 0.25, "majority": 0.25, "majority_answer": "2",
        "start": {"accuracy": 0.25, "rejected": 0.5}, "start_model": str(start)}
