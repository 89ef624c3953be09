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
"""

from __future__ import annotations

import logging
import sys
from collections import Counter
from pathlib import Path

import torch

from veomni.checkpoint.export import load_run_weights
from veomni.contract import build_model
from veomni.data.chat.conversation import TemplateChat
from veomni.data.chat.preference_dataset import read_preferred_conversations
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


def evaluate(run_dir: Path, checkpoint: Path | None, split: str, limit: int | None,
             max_answer_tokens: int = DEFAULT_MAX_ANSWER_TOKENS) -> dict[str, float]:
    run_cfg, _, weights, checkpoint = load_run_weights(run_dir, checkpoint)
    _, model = build_model(run_cfg.model.arch, run_cfg.model.options)
    model.load_state_dict(weights)
    model.eval()
    data = run_cfg.data
    tokenizer = load_tokenizer(data.tokenizer)
    chat = TemplateChat(tokenizer)
    path = data.eval_path if split == "eval" else data.train_path
    if not path:
        raise ValueError(f"the run has no data.{split}_path to evaluate on")
    read = read_preferred_conversations if data.kind == "chat_preference" else read_conversations
    conversations = list(read(path, data.text_key))[:limit]
    train_paths = [data.train_path] if data.train_path else [source.path for source in data.sources]
    train_answers = Counter(split_last_answer(messages)[1].strip() for train_path in train_paths
                            for _, messages in read(train_path, data.text_key))
    majority = train_answers.most_common(1)[0][0] if train_answers else ""
    stop = {tokenizer.eos_token_id, *tokenizer.all_special_ids}
    correct = echo = common = 0
    for start in range(0, len(conversations), DECODE_BATCH):
        chunk = [(key, split_last_answer(messages)) for key, messages in conversations[start:start + DECODE_BATCH]]
        prompts = [chat.prompt(before, key) for key, (before, _, _) in chunk]
        for (_, (_, answer, question)), generated in zip(chunk, greedy_answers(model, prompts, stop,
                                                                                max_answer_tokens)):
            answer = answer.strip()
            correct += tokenizer.decode(generated, skip_special_tokens=True).strip() == answer
            echo += question.strip() == answer
            common += majority == answer
    n = len(conversations)
    if not n:
        raise ValueError(f"no conversation with an assistant turn in {path}")
    logger.info("evaluated %s on %d %s conversations", checkpoint, n, split)
    return {"conversations": n, "accuracy": correct / n, "echo": echo / n, "majority": common / n,
            "majority_answer": majority}


def format_result(result: dict[str, float]) -> str:
    return "\n".join([
        f"exact match of greedy answers on {result['conversations']} held-out conversations:",
        f"  model                            {result['accuracy']:7.1%}",
        f"  echo (the user's last message)   {result['echo']:7.1%}",
        f"  majority ({result['majority_answer']!r})".ljust(35) + f"{result['majority']:7.1%}",
    ])


def main(argv: list[str] | None = None) -> int:
    return run_eval_command(argv, "veomni.eval.chat_exact_match", __doc__, "conversations", DEFAULT_MAX_ANSWER_TOKENS,
                            "decode at most N tokens per answer (default %(default)s)", evaluate,
                            format_result)


if __name__ == "__main__":
    sys.exit(main())
