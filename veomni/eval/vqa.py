"""Held-out answer accuracy of a trained omni model, per question type, against the majority class.

    python -m veomni.eval.vqa OUTPUT_DIR [--checkpoint STEP_DIR] [--split eval] [--limit N]
                              [--max-answer-tokens N]
    bash scripts/eval_vqa.sh OUTPUT_DIR [same options]

Loads the newest complete checkpoint of the run (or ``--checkpoint``) into one CPU process,
greedily decodes an answer for every sample of the split from its prompt (the chat up to the
assistant's turn, media included; prompts are decoded 64 at a time by ``veomni.generation``) and
counts exact matches with the reference answer (both stripped and lower-cased). An answer ends
at the tokenizer's eos or after ``--max-answer-tokens`` tokens (default 8: the bundled sets'
answers are a word or a short caption), so a reference answer longer than that can never
match: raise it for longer answers. Samples are grouped by their ``question_type`` field. The
baseline answers every question of a type with that type's most common answer in the
*training* split.

For a preference run (``data.kind: chat_media_preference``) each pair's prompt is decoded and the
reference is its chosen reply, compared exactly (stripped only, case and punctuation kept: the
pairs teach an answer's form); the ``rejected`` column counts answers equal to the rejected reply
(the form the pairs move away from), and the majority baseline is the most common chosen reply.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter, defaultdict
from pathlib import Path

import torch

from veomni.checkpoint.export import load_checkpoint_weights
from veomni.checkpoint.manager import list_checkpoints
from veomni.contract import build_model
from veomni.contract.media import MediaLayout
from veomni.data.chat.media_dataset import ChatSample, SampleProcessor
from veomni.data.sources import ReadStats, iter_tar_samples, resolve_files
from veomni.data.text.packed import load_tokenizer
from veomni.eval.command import run_eval_command
from veomni.generation import SamplingParams, generate

logger = logging.getLogger(__name__)
DEFAULT_MAX_ANSWER_TOKENS = 8
"""Answer tokens decoded per sample unless ``--max-answer-tokens`` says otherwise."""
DECODE_BATCH = 64


def _records(path: str) -> list[dict]:
    _, files = resolve_files(path, "webdataset")
    return list(iter_tar_samples(files, max_bad_fraction=1.0, stats=ReadStats(), warn=True))


def as_conversation(record: dict, json_key: str) -> dict:
    """A preference pair's record as the conversation it prefers (prompt + chosen), its rejected
    reply kept as ``rejected_answer``."""
    pair = json.loads(record[json_key])
    meta = {k: v for k, v in pair.items() if k not in ("prompt", "chosen", "rejected")}
    meta.update(messages=[*pair["prompt"], *pair["chosen"]], rejected_answer=pair["rejected"][-1]["content"])
    return {**record, json_key: json.dumps(meta).encode()}


def _normalise(answer: str, exact: bool) -> str:
    return answer.strip() if exact else answer.strip().lower()


def _reference(record: dict, process: SampleProcessor, exact: bool = False) -> tuple[str, str]:
    meta = process.messages(record)
    answer = meta["messages"][-1]["content"] if meta["messages"][-1].get("role") == "assistant" else ""
    return str(meta.get("question_type", "all")), _normalise(answer, exact)


def greedy_answers(
    model: torch.nn.Module, prompts: list[ChatSample], eos_id: int,
    max_tokens: int = DEFAULT_MAX_ANSWER_TOKENS, layout: MediaLayout | None = None,
) -> list[list[int]]:
    """Greedy continuations of many chat prompts at once, media included (``veomni.generation.
    generate``), each at most ``max_tokens`` long (eos excluded). ``layout``: the model's
    ``MediaLayout`` (its positions of the prompts' tokens)."""
    params = SamplingParams(max_new_tokens=max_tokens, stop_token_ids=(eos_id,))
    return [done.answer for done in generate(model, prompts, params, layout=layout)]


def majority_answers(records: list[dict], process: SampleProcessor, exact: bool = False) -> dict[str, str]:
    counts: dict[str, Counter] = defaultdict(Counter)
    for record in records:
        qtype, answer = _reference(record, process, exact)
        counts[qtype][answer] += 1
    return {qtype: c.most_common(1)[0][0] for qtype, c in counts.items()}


def evaluate(
    run_dir: Path, checkpoint: Path | None, split: str, limit: int | None,
    max_answer_tokens: int = DEFAULT_MAX_ANSWER_TOKENS,
) -> dict[str, dict[str, float]]:
    if checkpoint is None:
        found = list_checkpoints(run_dir / "checkpoints")
        if not found:
            raise FileNotFoundError(f"no complete checkpoint under {run_dir / 'checkpoints'}")
        checkpoint = found[-1][1]
    run_cfg, _, state = load_checkpoint_weights(checkpoint, run_dir / "config.yaml")
    model_cfg, model = build_model(run_cfg.model.arch, run_cfg.model.options)
    model.load_state_dict(state)
    model.eval()
    tokenizer = load_tokenizer(run_cfg.data.tokenizer)
    process = SampleProcessor(tokenizer, model_cfg, run_cfg.data.text_key, run_cfg.data.chat_markup)
    path = run_cfg.data.eval_path if split == "eval" else run_cfg.data.train_path
    pairs = run_cfg.data.kind == "chat_media_preference"

    def read(split_path: str) -> list[dict]:
        found = _records(split_path)
        return [as_conversation(r, run_cfg.data.text_key) for r in found] if pairs else found

    records = read(path)[:limit]
    majority = majority_answers(read(run_cfg.data.train_path), process, exact=pairs)
    correct: Counter = Counter()
    baseline: Counter = Counter()
    total: Counter = Counter()
    rejected: Counter = Counter()
    for start in range(0, len(records), DECODE_BATCH):
        chunk = records[start : start + DECODE_BATCH]
        prompts = [process(record, add_generation_prompt=True) for record in chunk]
        answers = greedy_answers(model, prompts, process.chat.answer_end[-1], max_answer_tokens, process.layout)
        for record, generated in zip(chunk, answers):
            qtype, answer = _reference(record, process, exact=pairs)
            said = _normalise(tokenizer.decode(generated), exact=pairs)
            total[qtype] += 1
            correct[qtype] += said == answer
            baseline[qtype] += majority.get(qtype) == answer
            if pairs:
                rejected[qtype] += said == process.messages(record)["rejected_answer"].strip()
    logger.info("evaluated %s on %d %s samples", checkpoint, sum(total.values()), split)
    result = {
        q: {
            "samples": total[q],
            "accuracy": correct[q] / total[q],
            "majority": baseline[q] / total[q],
            "majority_answer": majority.get(q, ""),
            **({"rejected": rejected[q] / total[q]} if pairs else {}),
        }
        for q in sorted(total)
    }
    n = sum(total.values())
    result["all"] = {
        "samples": n,
        "accuracy": sum(correct.values()) / n,
        "majority": sum(baseline.values()) / n,
        "majority_answer": "-",
        **({"rejected": sum(rejected.values()) / n} if pairs else {}),
    }
    return result


def format_table(result: dict[str, dict[str, float]]) -> str:
    pairs = "rejected" in result["all"]
    lines = [f"{'question type':<14}{'samples':>8}{'accuracy':>10}{'majority':>10}"
             + (f"{'rejected':>10}" if pairs else "") + "  majority answer"]
    for qtype, r in result.items():
        lines.append(
            f"{qtype:<14}{r['samples']:>8}{r['accuracy']:>10.1%}{r['majority']:>10.1%}"
            + (f"{r['rejected']:>10.1%}" if pairs else "") + f"  {r['majority_answer']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    return run_eval_command(argv, "veomni.eval.vqa", __doc__, "samples", DEFAULT_MAX_ANSWER_TOKENS,
                            "decode at most N tokens per answer (default %(default)s); a reference "
                            "answer longer than N tokens can never match", evaluate,
                            format_table)


if __name__ == "__main__":
    sys.exit(main())
