"""Packed, resumable loader of preference pairs (the ``chat_preference`` kind), for the preference
objectives (``train.objective: dpo | ipo | simpo``, docs/post_training.md).

A record is one pair in TRL's conversational preference format: a jsonl line, or a webdataset
sample's ``<key>.<text_key>`` member (``data.text_key: json``), holding
``{"prompt": [messages], "chosen": [messages], "rejected": [messages]}`` (an ``id`` names it),
OpenAI-style messages; each reply starts with an assistant turn. Each half (prompt + chosen,
prompt + rejected) is rendered with the tokenizer's chat template as ``chat_text`` renders a
conversation (``TemplateChat.encode_reply``), with targets on the reply's assistant turns only.

A pair is one item of the text loader: it is drawn, balanced, packed, checkpointed and resumed
whole, and packs as two adjacent samples, chosen then rejected, so both halves always share a
micro-batch (the objective reads sample ``2k`` and ``2k + 1`` as pair ``k``). Nothing is cut:
the launcher reads every pair of the train and eval data first (``check_preference_data``) and
refuses the run, naming file and record, when a pair is malformed (not JSON, a missing or empty
prompt, chosen or rejected, a reply that is not an assistant's, a template that renders it
inconsistently), when a half is longer than ``data.max_seq_len``, or when the pair does not fit
``data.tokens_per_micro_batch`` (its size is stated).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from veomni.config.schema import DataConfig
from veomni.data.chat.conversation import ChatTokens, TemplateChat, conversation_messages
from veomni.data.chat.text_dataset import ChatTextDataset, check_chat_template, record_object
from veomni.data.kinds import DatasetKind, DatasetRequest, register_dataset
from veomni.data.mixture import SourceSpec
from veomni.data.packing import pack_with_targets
from veomni.data.sources import InvalidSampleError, ReadStats, count_bad, resolve_files, tar_samples
from veomni.data.text.packed import check_sample_length

if TYPE_CHECKING:  # transformers loads in a second; only text datasets need it
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

HALVES = ("chosen", "rejected")
MAX_LISTED = 10
"""Malformed pairs the launcher names before it stops listing."""


@dataclass(frozen=True)
class PairTokens:
    chosen: ChatTokens
    rejected: ChatTokens

    @property
    def size(self) -> int:
        return len(self.chosen.ids) + len(self.rejected.ids)


def check_pair_lists(obj: Any, key: str) -> None:
    """An ``InvalidSampleError`` unless ``obj`` holds non-empty ``prompt``, ``chosen`` and ``rejected`` lists."""
    if not isinstance(obj, Mapping):
        raise InvalidSampleError(f"pair {key!r}: expected an object with 'prompt', 'chosen' and 'rejected' lists")
    for name in ("prompt", *HALVES):
        turns = obj.get(name)
        if not isinstance(turns, list) or not turns:
            state = "is missing" if name not in obj else "is empty" if turns == [] else "is not a list of messages"
            raise InvalidSampleError(f"pair {key!r}: {name!r} {state} (TRL's conversational preference format: "
                                     "prompt, chosen and rejected are lists of messages)")


def pair_messages(obj: Any, key: str) -> tuple[list[dict[str, str]], list[dict[str, str]], list[dict[str, str]]]:
    """``(prompt, chosen, rejected)`` messages of one pair object; an ``InvalidSampleError`` saying
    what is wrong."""
    check_pair_lists(obj, key)
    prompt_turns = len(obj["prompt"])
    halves = []
    for name in HALVES:
        reply = conversation_messages({"messages": [*obj["prompt"], *obj[name]]}, f"{key}.{name}")[prompt_turns:]
        if reply[0]["role"] != "assistant":
            raise InvalidSampleError(f"pair {key!r}: {name!r} must start with the assistant's reply, not a "
                                     f"{reply[0]['role']} turn")
        halves.append(reply)
    prompt = conversation_messages({"messages": [*obj["prompt"], *obj["chosen"]]}, key)[:prompt_turns]
    return prompt, halves[0], halves[1]


def encode_pair(chat: TemplateChat, obj: Any, key: str) -> PairTokens:
    prompt, chosen, rejected = pair_messages(obj, key)
    return PairTokens(chat.encode_reply(prompt, chosen, key), chat.encode_reply(prompt, rejected, key))


def pair_problem(key: str, cfg: DataConfig, lengths: tuple[int, int], costs: tuple[int, int],
                 what: str = "tokens") -> str:
    """Why a well-formed pair cannot train under ``cfg`` ('' when it can): nothing is ever cut.
    ``lengths``: each half's tokens; ``costs``: each half's cost in a micro-batch, in ``what``."""
    for name, length in zip(HALVES, lengths):
        if length > cfg.max_seq_len:
            return (f"pair {key!r}: its {name} half has {length} tokens, over data.max_seq_len="
                    f"{cfg.max_seq_len}; raise it or drop the pair")
    if sum(costs) > cfg.tokens_per_micro_batch:
        return (f"pair {key!r} has {sum(costs)} {what} (chosen {costs[0]} + rejected {costs[1]}) and cannot fit a "
                f"micro-batch of data.tokens_per_micro_batch={cfg.tokens_per_micro_batch}; both halves must share "
                "one, so raise it or drop the pair")
    return ""


def token_pair_problem(pair: PairTokens, key: str, cfg: DataConfig) -> str:
    lengths = (len(pair.chosen.ids), len(pair.rejected.ids))
    return pair_problem(key, cfg, lengths, lengths)


class ChatPreferenceDataset(ChatTextDataset):
    """``ChatTextDataset`` whose item is a pair (see the module docstring)."""

    def _cost(self, item: PairTokens) -> int:
        return item.size

    def _pack(self, items: list[PairTokens]) -> dict:
        halves = [half for pair in items for half in (pair.chosen, pair.rejected)]
        return pack_with_targets([h.ids for h in halves], [h.targets for h in halves])

    def _encode(self, record: Any, spec: SourceSpec, stats: ReadStats) -> PairTokens | None:
        origin = record.get("__url__", spec.path) if isinstance(record, dict) else spec.path
        try:
            key, obj = record_object(record, self.formats[spec.name], spec.text_key)
            pair = encode_pair(self.chat, obj, key)
            problem = token_pair_problem(pair, key, self.cfg)
            if problem:
                raise InvalidSampleError(problem)
        except InvalidSampleError as error:  # the launcher refuses these; data changed since?
            logger.warning("%s: skipped, counted as bad: %s", origin, error)
            count_bad(stats, origin, self.cfg.max_bad_fraction)
            return None
        return pair


def records_of(path: str, fmt: str) -> Iterator[tuple[str, str, Any]]:
    """``(file and line or member, format, raw record)`` of every record under ``path``."""
    fmt, files = resolve_files(path, fmt)
    for file in files:
        if fmt == "webdataset":
            for sample in tar_samples(file):
                yield f"{file} sample {sample.get('__key__', '?')!r}", fmt, sample
            continue
        with open(file, "rb") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    yield f"{file}:{number}", fmt, line


def read_pair_conversations(path: str, text_key: str = "json"
                            ) -> Iterator[tuple[str, list[dict[str, str]], list[dict[str, str]]]]:
    """Each good pair of a split as its two conversations, ``(key, prompt + chosen, prompt +
    rejected)``, in file order: what a preference run's greedy answers are scored against
    (``veomni.eval.chat_exact_match``); bad pairs are skipped with a warning."""
    for where, fmt, record in records_of(path, "auto"):
        try:
            key, obj = record_object(record, fmt, text_key)
            prompt, chosen, rejected = pair_messages(obj, key)
        except InvalidSampleError as error:
            logger.warning("%s: skipped: %s", where, error)
            continue
        yield key, [*prompt, *chosen], [*prompt, *rejected]


PairCheck = Callable[[str, str, str, Any, str], str]
"""(the source's path, where: file and line or member, format, raw record, its text key) -> why the pair
is refused, or ''."""


def pair_problems(cfg: DataConfig, kind: str, check: PairCheck) -> list[str]:
    """``check`` on every pair of the train sources and the eval split: a problem per bad pair (the
    first ``MAX_LISTED``), naming file and record, and the count of the rest."""
    paths = [(s.path, s.format or cfg.format, s.text_key or cfg.text_key) for s in cfg.sources] or \
        [(cfg.train_path, cfg.format, cfg.text_key)]
    if cfg.eval_path:
        paths.append((cfg.eval_path, cfg.format, cfg.text_key))
    problems: list[str] = []
    bad = 0
    for path, fmt, text_key in paths:
        for where, found, record in records_of(path, fmt):
            problem = check(path, where, found, record, text_key)
            if problem:
                bad += 1
                if len(problems) < MAX_LISTED:
                    problems.append(f"data ({kind}): {where}: {problem}")
    if bad > len(problems):
        problems.append(f"data ({kind}): {bad - len(problems)} more bad pairs not listed")
    return problems


def preference_problems(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """Every pair read, rendered and sized (``pair_problems``)."""
    chat = TemplateChat(tokenizer)

    def check(path: str, where: str, fmt: str, record: Any, text_key: str) -> str:
        try:
            key, obj = record_object(record, fmt, text_key)
            return token_pair_problem(encode_pair(chat, obj, key), key, cfg)
        except InvalidSampleError as error:
            return str(error)

    return pair_problems(cfg, "chat_preference", check)


def check_preference_data(cfg: DataConfig, model_config: Any) -> list[str]:
    """The chat kind's checks of the tokenizer and its template, then every pair (before any worker starts)."""
    problems = check_chat_template(cfg, model_config)
    if problems:
        return problems
    from transformers import AutoTokenizer

    return preference_problems(cfg, AutoTokenizer.from_pretrained(cfg.tokenizer, local_files_only=True))


def _build_chat_preference(request: DatasetRequest) -> ChatPreferenceDataset:
    r = request
    return ChatPreferenceDataset(r.cfg, r.split, r.tokenizer, r.dp_rank, r.dp_size, r.seed)


register_dataset(DatasetKind("chat_preference", _build_chat_preference, needs_tokenizer=True,
                             check=check_preference_data, check_plan=check_sample_length, balances=True))
