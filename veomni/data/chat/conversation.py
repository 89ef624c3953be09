"""Conversations -> token ids and loss targets, rendered by the tokenizer's own chat template.

Why the tokenizer's template and not a layout of ours: a chat model is served with its
tokenizer's template (``apply_chat_template`` in transformers, vLLM, ...); fine-tuning it on any
other layout teaches a format it never sees when it answers.

Input: OpenAI-style ``{"messages": [{"role": ..., "content": ...}]}`` or ShareGPT
``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}``; roles are
``system``, ``user``, ``assistant``, contents are strings (a user's or assistant's not empty), and
at least one turn is the assistant's. Anything else is an ``InvalidSampleError`` naming the sample.

Templates are judged by the text they render, never by how its pieces tokenize: the whole
conversation is rendered once and tokenized once (what is trained on), and the loss targets are
character spans of that text, mapped to tokens with the tokenizer's offsets. A token is a target
when it covers any character of a span, so a token that straddles a span's edge (a space the
generation prompt ends with, merged into the answer's first word) is a target: the rule of
transformers' ``assistant_masks``. The spans:

- a template with ``{% generation %}`` markers: the marked text, exactly transformers'
  ``apply_chat_template(..., return_assistant_tokens_mask=True)`` (text the template writes after
  ``{% endgeneration %}``, a turn's newline, is no target). Templates that render earlier turns
  differently once later ones follow (drop earlier reasoning, move the system prompt) are fine:
  the marks are on the whole conversation as rendered, as TRL's assistant-only loss trains it.
- a template without them: for the assistant turn ``k`` the template renders ``messages[:k]``
  with the generation prompt and ``messages[:k + 1]``; the text between the two (the answer and
  everything the template closes the turn with, up to the next turn) is the span. Both must be
  character prefixes of the whole rendering; a template for which they are not rewrites earlier
  turns, and the sample fails with an ``InvalidSampleError`` that says so and how to fix it (mark
  the template); the launcher renders probe conversations first (``template_probe``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from veomni.data.chat.template import ROLES
from veomni.data.sources import InvalidSampleError
from veomni.errors import BadData

if TYPE_CHECKING:  # transformers loads in a second; only text datasets need it
    from transformers import PreTrainedTokenizerBase

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
"""ShareGPT's ``from`` -> the role the template takes."""


def conversation_messages(obj: Any, key: str) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` of one OpenAI-style or ShareGPT conversation object."""
    if isinstance(obj, Mapping) and isinstance(obj.get("messages"), list):
        turns, role_key, content_key, roles = obj["messages"], "role", "content", {r: r for r in ROLES}
    elif isinstance(obj, Mapping) and isinstance(obj.get("conversations"), list):
        turns, role_key, content_key, roles = obj["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise InvalidSampleError(f"sample {key!r}: expected an object with a 'messages' list (OpenAI style) or a "
                                 "'conversations' list (ShareGPT)")
    messages = []
    for index, turn in enumerate(turns):
        if not isinstance(turn, Mapping) or role_key not in turn:
            raise InvalidSampleError(f"sample {key!r}: turn {index} has no {role_key!r}: {turn!r}")
        role = roles.get(turn[role_key]) if isinstance(turn[role_key], str) else None
        if role is None:
            raise InvalidSampleError(f"sample {key!r}: turn {index} has the unknown {role_key} {turn[role_key]!r}; "
                                     f"expected one of {sorted(roles)}")
        if not isinstance(turn.get(content_key), str):
            raise InvalidSampleError(f"sample {key!r}: turn {index} ({role}) needs a string {content_key!r}")
        if role != "system" and not turn[content_key].strip():
            raise InvalidSampleError(f"sample {key!r}: turn {index} ({role}) has an empty {content_key!r}")
        messages.append({"role": role, "content": turn[content_key]})
    if not any(m["role"] == "assistant" for m in messages):
        raise InvalidSampleError(f"sample {key!r}: no assistant turn, so nothing to train on")
    return messages


@dataclass(frozen=True)
class ChatTokens:
    """One conversation's tokens: ``targets[i]`` says token ``i`` is a loss target."""

    ids: list[int]
    targets: list[bool]


class TemplateRefusal(InvalidSampleError):
    """The chat template raised on a conversation (``raise_exception``, a jinja error)."""


GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")
"""A ``{% generation %}`` tag, as transformers looks for it."""

MARK_THE_TEMPLATE = ("wrap each assistant turn's text in the template in {% generation %} ... {% endgeneration %} "
                     "(the conversation is then rendered once and the marked text is the loss target, as "
                     "transformers' return_assistant_tokens_mask and TRL's assistant-only loss take it), or use a "
                     "template that renders earlier turns the same whatever follows them")
"""What to do about a template without marks that rewrites earlier turns."""


def span_targets(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Token ``i`` (characters ``offsets[i]``) is a target when it covers a character of a span
    (spans ascending, not overlapping): a token straddling a span's edge is one."""
    targets, span = [], 0
    for start, end in offsets:
        while span < len(spans) and start >= spans[span][1]:
            span += 1
        targets.append(span < len(spans) and end > spans[span][0])
    return targets


class TemplateChat:
    """Renders conversations with ``tokenizer``'s chat template (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        problem = missing_template(tokenizer) or slow_tokenizer(tokenizer)
        if problem:
            raise BadData(problem)
        self.tokenizer = tokenizer
        self.marked = GENERATION_MARK.search(tokenizer.get_chat_template()) is not None

    def _apply(self, messages: Sequence[Mapping[str, str]], key: str, **kwargs: Any) -> Any:
        """``apply_chat_template``; an ``InvalidSampleError`` when the template refuses the messages."""
        try:
            return self.tokenizer.apply_chat_template(list(messages), **kwargs)
        except Exception as error:  # noqa: BLE001 - a template raises what it likes (jinja2 errors, raise_exception)
            raise TemplateRefusal(f"sample {key!r}: the chat template refused the conversation "
                                  f"({type(error).__name__}: {error})") from error

    def text(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool, key: str) -> str:
        return self._apply(messages, key, tokenize=False, add_generation_prompt=generation_prompt)

    def encode_reply(self, prompt: Sequence[Mapping[str, str]], reply: Sequence[Mapping[str, str]],
                     key: str) -> ChatTokens:
        """``prompt + reply`` rendered whole, with targets on the reply's assistant turns only (assistant
        turns inside the prompt are context): a preference pair's half, as TRL's completions. The reply
        starts where the prompt's rendering with the assistant's header ends, in characters, so a token
        merge at that boundary moves nothing (a token straddling it is a target, as in ``span_targets``)."""
        messages = [*prompt, *reply]
        chat = self.encode(messages, key)
        text = self.text(messages, False, key)
        start = self._prefix_length(text, prompt, True, len(prompt), key)
        offsets = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        if len(offsets) != len(chat.ids):
            raise InvalidSampleError(f"sample {key!r}: the template's tokens ({len(chat.ids)}) are not the rendered "
                                     f"text's ({len(offsets)}), so the reply's tokens cannot be found")
        return ChatTokens(chat.ids, [target and end > start for target, (_, end) in zip(chat.targets, offsets)])

    def prompt(self, messages: Sequence[Mapping[str, str]], key: str) -> list[int]:
        """Ids of ``messages`` followed by the assistant's header: what a model answers from."""
        return self.tokenizer.encode(self.text(messages, True, key), add_special_tokens=False)

    def encode(self, messages: Sequence[Mapping[str, str]], key: str) -> ChatTokens:
        """The whole conversation's ids (the template writes any special tokens itself, so none are
        added) and its assistant spans' tokens as targets."""
        if self.marked:
            out = self._apply(messages, key, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
            return ChatTokens(list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]])
        text = self.text(messages, False, key)
        spans = [(self._prefix_length(text, messages[:k], True, k, key),
                  self._prefix_length(text, messages[:k + 1], False, k, key))
                 for k, message in enumerate(messages) if message["role"] == "assistant"]
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return ChatTokens(list(encoding["input_ids"]), span_targets(encoding["offset_mapping"], spans))

    def fit(self, messages: Sequence[Mapping[str, str]], key: str, max_len: int) -> ChatTokens:
        """The conversation through its last assistant turn whose rendering ends within ``max_len``
        tokens, rendered on its own (whole turns only: no target loses its context, and turns after
        the last answer teach nothing); an ``InvalidSampleError`` when not even the first answer fits.
        A binary search over the number of answers kept: renderings grow with the turns they hold."""
        ends = [k + 1 for k, message in enumerate(messages) if message["role"] == "assistant"]
        chat = self.encode(messages[:ends[-1]], key)
        if len(chat.ids) <= max_len:
            return chat
        low, high, best = 0, len(ends) - 2, None
        while low <= high:
            middle = (low + high) // 2
            chat = self.encode(messages[:ends[middle]], key)
            if len(chat.ids) <= max_len:
                best, low = chat, middle + 1
            else:
                high = middle - 1
        if best is None:  # every probe failed, the last one holding only the first answer
            raise InvalidSampleError(f"sample {key!r}: its first assistant turn ends at token {len(chat.ids)}, past "
                                     f"data.max_seq_len={max_len}")
        return best

    def _prefix_length(self, text: str, messages: Sequence[Mapping[str, str]], generation_prompt: bool,
                       turn: int, key: str) -> int:
        prefix = self.text(messages, generation_prompt, key)
        if text.startswith(prefix):
            return len(prefix)
        differ = next((i for i, (a, b) in enumerate(zip(text, prefix)) if a != b), min(len(text), len(prefix)))
        what = "up to" if generation_prompt else "through"
        raise InvalidSampleError(
            f"sample {key!r}: the chat template renders the conversation {what} assistant turn {turn} differently "
            f"from the whole conversation (from character {differ}: {prefix[differ:differ + 40]!r} where the whole "
            f"has {text[differ:differ + 40]!r}): it rewrites earlier turns once later ones follow (moves the system "
            "prompt, drops earlier reasoning, ...), and it has no {% generation %} marks, so the turn's loss "
            f"targets cannot be found from rendered prefixes; {MARK_THE_TEMPLATE}")


def missing_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """Why ``tokenizer`` cannot render chats (no chat template), naming its folder; empty if it can."""
    if getattr(tokenizer, "chat_template", None):
        return ""
    folder = getattr(tokenizer, "name_or_path", "") or "(unknown folder)"
    return (f"the tokenizer {folder} has no chat template, and the chat_text kind renders conversations with the "
            f"tokenizer's own template: add one as \"chat_template\" (a Jinja string) to "
            f"{folder}/tokenizer_config.json or as {folder}/chat_template.jinja (the instruct model's template, "
            "or a ChatML one as data/build_chat_sft.py writes), or point data.tokenizer at a tokenizer that has one")


def slow_tokenizer(tokenizer: PreTrainedTokenizerBase) -> str:
    """Why ``tokenizer`` cannot map rendered text to tokens (no character offsets); empty if it can."""
    if tokenizer.is_fast:
        return ""
    return (f"the tokenizer {tokenizer.name_or_path} is a Python (slow) tokenizer, which gives no character "
            "offsets, and the chat_text kind maps the template's rendered text to tokens with them: save the "
            "tokenizer with a tokenizer.json (a fast tokenizer: transformers converts most slow ones when loading "
            "them with use_fast=True)")
