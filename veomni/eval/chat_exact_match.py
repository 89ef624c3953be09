"""Held-out exact-match accuracy of a chat model's greedy answers, against two baselines.

    python -m veomni.eval.chat_exact_match OUTPUT_DIR [--checkpoint STEP_DIR] [--split eval|train]
                                           [--limit N] [--max-answer-tokens N] [--json FILE]
    bash scripts/eval_chat.sh OUTPUT_DIR [same options]

Why: the eval loss of a ``chat_text`` run says how well the model predicts the answers' tokens,
not whether its answers are right; a task with exact answers can say that directly.

Loads the newest complete checkpoint of the run (or ``--checkpoint``; EMA weights where kept) into
one CPU process. Each conversation of the split (the run's ``data.eval_path``, read as the
``chat_text`` kind reads it; for a ``chat_preference`` run, each pair's prompt + chosen reply) is
cut before its last assistant turn; the rest is rendered by the
run's tokenizer's chat template with the generation prompt, and the answer decoded greedily (64
prompts at a time, ``veomni.generation`` with its KV cache) until the tokenizer's eos or any other special token, or
``--max-answer-tokens`` (default 32). It is right when it equals the reference (both stripped).
Baselines: ``echo`` answers with the last user message as given (a model that copies its
input), ``majority`` with the most common last answer of the training split (one that ignores
it). The model's accuracy must beat both to show it learned the task.

A preference run is scored against both replies of each pair (``accuracy``: the chosen one,
``rejected``: the rejected one), and the model it started from (``checkpoint.init_from_hf``, the
reference DPO compares with) is scored on the same prompts (``start``): the baseline of the
behaviour the pairs teach, printed beside the run's figures with the change in points.
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from pathlib import Path

import torch

from veomni.checkpoint.export import load_run_weights
from veomni.checkpoint.hf_io import load_hf_pretrained
from veomni.contract import build_model
from veomni.data.chat.conversation import TemplateChat
from veomni.data.chat.preference_dataset import read_pair_conversations
from veomni.data.chat.text_dataset import read_conversations
from veomni.data.text.packed import load_tokenizer
from veomni.eval.command import run_eval_command
from veomni.generation import SamplingParams, generate

logger = logging.getLogger(__name__)
DEFAULT_MAX_ANSWER_TOKENS = 32
DECODE_BATCH = 64


def greedy_answers(model: torch.nn.Module, prompts: list[list[int]], stop: set[int],
                   max_tokens: int = DEFAULT_MAX_ANSWER_TOKENS) -> list[list[int]]:
    """Greedy continuations of many prompts at once (``veomni.generation.generate``), each ending
    before a ``stop`` token or after ``max_tokens``."""
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=tuple(sorted(stop)))
    return [done.answer for done in generate(model, prompts, params)]


def split_last_answer(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], str, str]:
    """``(the turns before the last assistant turn, its content, the last user content before it)``."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    question = next((m["content"] for m in reversed(messages[:last]) if m["role"] == "user"), "")
    return messages[:last], messages[last]["content"], question


def _read_split(path: str, text_key: str, preference: bool
                ) -> list[tuple[str, list[dict[str, str]], list[dict[str, str]] | None]]:
    """``(key, the conversation scored, the rejected one of its pair or None)`` of a split."""
    if preference:
        return list(read_pair_conversations(path, text_key))
    return [(key, messages, None) for key, messages in read_conversations(path, text_key)]


def score_answers(model: torch.nn.Module, tokenizer, chat: TemplateChat, conversations: list,
                  max_answer_tokens: int) -> dict[str, float]:
    """The share of greedy answers equal to each conversation's last assistant answer (``accuracy``)
    and, for pairs, to the rejected reply's (``rejected``)."""
    stop = {tokenizer.eos_token_id, *tokenizer.all_special_ids}
    correct = rejected = 0
    for start in range(0, len(conversations), DECODE_BATCH):
        chunk = conversations[start:start + DECODE_BATCH]
        prompts = [chat.prompt(split_last_answer(messages)[0], key) for key, messages, _ in chunk]
        for (_, messages, other), generated in zip(chunk, greedy_answers(model, prompts, stop, max_answer_tokens)):
            said = tokenizer.decode(generated, skip_special_tokens=True).strip()
            correct += said == split_last_answer(messages)[1].strip()
            rejected += other is not None and said == split_last_answer(other)[1].strip()
    scores = {"accuracy": correct / len(conversations)}
    if conversations[0][2] is not None:
        scores["rejected"] = rejected / len(conversations)
    return scores


def _built(run_cfg, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    _, model = build_model(run_cfg.model.arch, run_cfg.model.options)
    model.load_state_dict(weights)
    return model.eval()


def evaluate(run_dir: Path, checkpoint: Path | None, split: str, limit: int | None,
             max_answer_tokens: int = DEFAULT_MAX_ANSWER_TOKENS) -> dict[str, float]:
    run_cfg, _, weights, checkpoint = load_run_weights(run_dir, checkpoint)
    data = run_cfg.data
    tokenizer = load_tokenizer(data.tokenizer)
    chat = TemplateChat(tokenizer)
    path = data.eval_path if split == "eval" else data.train_path
    if not path:
        raise ValueError(f"the run has no data.{split}_path to evaluate on")
    preference = data.kind == "chat_preference"
    conversations = _read_split(path, data.text_key, preference)[:limit]
    if not conversations:
        raise ValueError(f"no conversation with an assistant turn in {path}")
    train_paths = [data.train_path] if data.train_path else [source.path for source in data.sources]
    train_answers = Counter(split_last_answer(messages)[1].strip() for train_path in train_paths
                            for _, messages, _ in _read_split(train_path, data.text_key, preference))
    majority = train_answers.most_common(1)[0][0] if train_answers else ""
    answers = [split_last_answer(messages)[1:] for _, messages, _ in conversations]
    n = len(conversations)
    result = {"conversations": n, **score_answers(_built(run_cfg, weights), tokenizer, chat, conversations,
                                                  max_answer_tokens),
              "echo": sum(question.strip() == answer.strip() for answer, question in answers) / n,
              "majority": sum(majority == answer.strip() for answer, _ in answers) / n, "majority_answer": majority}
    logger.info("evaluated %s on %d %s conversations", checkpoint, n, split)
    start = run_cfg.checkpoint.init_from_hf
    if preference and start:  # what the preference run started from: the baseline of its answers
        result["start"] = score_answers(_built(run_cfg, load_hf_pretrained(start)[2]), tokenizer, chat,
                                        conversations, max_answer_tokens)
        result["start_model"] = start
        logger.info("evaluated the starting model %s on the same conversations", start)
    return result


def format_result(result: dict[str, float]) -> str:
    lines = [f"exact match of greedy answers on {result['conversations']} held-out conversations:"]
    if "rejected" in result:  # a preference run: each pair's two replies, before and after
        start = result.get("start")
        lines.append(f"  {'':33}{'start' if start else '':>8}{'model':>8}{'change' if start else '':>9}")
        for name, key in (("= the chosen reply", "accuracy"), ("= the rejected reply", "rejected")):
            row = f"  {name:33}"
            if start:
                row += f"{start[key]:8.1%}{result[key]:8.1%}{100 * (result[key] - start[key]):+8.1f} points"
            else:
                row += f"{'':8}{result[key]:8.1%}"
            lines.append(row)
        if start:
            lines.append(f"  (start: {result['start_model']}, the run's checkpoint.init_from_hf)")
    else:
        lines.append(f"  model                            {result['accuracy']:7.1%}")
    return "\n".join([
        *lines,
        f"  echo (the user's last message)   {result['echo']:7.1%}",
        f"  majority ({result['majority_answer']!r})".ljust(35) + f"{result['majority']:7.1%}",
    ])


def main(argv: list[str] | None = None) -> int:
    return run_eval_command(argv, "veomni.eval.chat_exact_match", __doc__, "conversations", DEFAULT_MAX_ANSWER_TOKENS,
                            "decode at most N tokens per answer (default %(default)s)", evaluate,
                            format_result)


if __name__ == "__main__":
    sys.exit(main())
