"""Conversations -> token ids and loss targets, rendered by the tokenizer's own chat template.

Why the tokenizer's template and not a layout of ours: a chat model is served with its
tokenizer's template (``apply_chat_template`` in transformers, vLLM, ...); fine-tuning it on any
other layout teaches a format it never sees when it answers.

Input: OpenAI-style ``{"messages": [{"role": ..., "content": ...}]}`` or ShareGPT
``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}``; roles are
``system``, ``user``, ``assistant``, contents are strings, and at least one turn is the
assistant's. Anything else is an ``InvalidSampleError`` naming the sample.

Targets by growing prefixes, so any template works (``{% generation %}`` markers or not): for
the assistant turn ``k`` the template renders ``messages[:k]`` with the generation prompt (up to
the assistant's content, its role header included) and ``messages[:k + 1]`` (through the content
and whatever closes the turn, e.g. ``<|im_end|>\\n``); the tokens between the two are the turn's
targets. Each rendering must be a token prefix of the whole conversation rendered at once (what
is trained on); a template for which it is not (one that renders a turn differently once later
turns follow, e.g. drops earlier reasoning) fails the sample with an ``InvalidSampleError`` that
says so, and the launcher tries a probe conversation first (``chat_template_problems``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from veomni.data.chat.template import ROLES
from veomni.data.sources import InvalidSampleError

if TYPE_CHECKING:  # transformers loads in a second; only text datasets need it
    from transformers import PreTrainedTokenizerBase

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
"""ShareGPT's ``from`` -> the role the template takes."""

PROBE = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi."},
         {"role": "user", "content": "Again, please."}, {"role": "assistant", "content": "Hi again."}]
"""A two-exchange conversation the launcher renders to check a template before any worker starts."""


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
        messages.append({"role": role, "content": turn[content_key]})
    if not any(m["role"] == "assistant" for m in messages):
        raise InvalidSampleError(f"sample {key!r}: no assistant turn, so nothing to train on")
    return messages


@dataclass(frozen=True)
class ChatTokens:
    """One conversation's tokens: ``targets[i]`` says token ``i`` is a loss target;
    ``turn_ends``: where each assistant turn's tokens end (exclusive), in order."""

    ids: list[int]
    targets: list[bool]
    turn_ends: tuple[int, ...]

    def fit(self, max_len: int) -> ChatTokens | None:
        """The conversation through its last assistant turn that ends within ``max_len`` tokens
        (whole turns only: no target loses its context, and turns after the last answer teach
        nothing); None when not even the first answer fits."""
        ends = tuple(end for end in self.turn_ends if end <= max_len)
        if not ends:
            return None
        return ChatTokens(self.ids[:ends[-1]], self.targets[:ends[-1]], ends)


class TemplateChat:
    """Renders conversations with ``tokenizer``'s chat template (see the module docstring)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        problem = missing_template(tokenizer)
        if problem:
            raise ValueError(problem)
        self.tokenizer = tokenizer

    def render(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool, key: str) -> list[int]:
        """Token ids of the template's text for ``messages`` (the template writes any special tokens
        itself, so none are added); an ``InvalidSampleError`` when the template refuses them."""
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as error:  # noqa: BLE001 - a template raises what it likes (jinja2 errors, raise_exception)
            raise InvalidSampleError(f"sample {key!r}: the chat template refused the conversation "
                                     f"({type(error).__name__}: {error})") from error
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, messages: Sequence[Mapping[str, str]], key: str) -> ChatTokens:
        """The whole conversation's ids, its assistant turns' tokens (content and turn end) as
        targets; an ``InvalidSampleError`` when a prefix does not render as a prefix."""
        ids = self.render(messages, False, key)
        targets = [False] * len(ids)
        ends = []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = self._prefix_length(ids, messages[:k], True, k, key)
            end = self._prefix_length(ids, messages[:k + 1], False, k, key)
            targets[start:end] = [True] * (end - start)
            ends.append(end)
        return ChatTokens(ids, targets, tuple(ends))

    def encode_reply(self, prompt: Sequence[Mapping[str, str]], reply: Sequence[Mapping[str, str]],
                     key: str) -> ChatTokens:
        """``prompt + reply`` rendered whole, with targets on the reply's assistant turns only (assistant
        turns inside the prompt are context): a preference pair's half, as TRL's completions."""
        chat = self.encode([*prompt, *reply], key)
        start = len(self.prompt(prompt, key))  # encode checked it renders as a prefix
        targets = [target and i >= start for i, target in enumerate(chat.targets)]
        return ChatTokens(chat.ids, targets, tuple(end for end in chat.turn_ends if end > start))

    def prompt(self, messages: Sequence[Mapping[str, str]], key: str) -> list[int]:
        """Ids of ``messages`` followed by the assistant's header: what a model answers from."""
        return self.render(messages, True, key)

    def _prefix_length(self, ids: list[int], messages: Sequence[Mapping[str, str]], generation_prompt: bool,
                       turn: int, key: str) -> int:
        prefix = self.render(messages, generation_prompt, key)
        if ids[:len(prefix)] != prefix:
            differ = next((i for i, (a, b) in enumerate(zip(ids, prefix)) if a != b), min(len(ids), len(prefix)))
            what = "up to" if generation_prompt else "through"
            raise InvalidSampleError(
                f"sample {key!r}: the chat template renders the conversation {what} assistant turn {turn} differently "
                f"from the whole conversation (first different token at {differ}), so the turn's targets cannot be "
                "found by prefixes; templates that rewrite earlier turns once later ones follow are not supported")
        return len(prefix)


def missing_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """Why ``tokenizer`` cannot render chats (no chat template), naming its folder; empty if it can."""
    if getattr(tokenizer, "chat_template", None):
        return ""
    folder = getattr(tokenizer, "name_or_path", "") or "(unknown folder)"
    return (f"the tokenizer {folder} has no chat template, and the chat_text kind renders conversations with the "
            f"tokenizer's own template: add one as \"chat_template\" (a Jinja string) to "
            f"{folder}/tokenizer_config.json or as {folder}/chat_template.jinja (the instruct model's template, "
            "or a ChatML one as data/build_chat_sft.py writes), or point data.tokenizer at a tokenizer that has one")


def chat_template_problems(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The launcher's check of a tokenizer's template: it exists, and the targets it gives ``PROBE``
    hold each answer."""
    problem = missing_template(tokenizer)
    if problem:
        return [problem]
    try:
        chat = TemplateChat(tokenizer).encode(PROBE, "probe")
    except InvalidSampleError as error:
        return [f"data.tokenizer {tokenizer.name_or_path}: its chat template cannot give loss masks: {error}"]
    starts = (0, *chat.turn_ends)
    answers = [tokenizer.decode([t for t, target in zip(chat.ids[a:b], chat.targets[a:b]) if target])
               for a, b in zip(starts, chat.turn_ends)]
    wanted = [m["content"] for m in PROBE if m["role"] == "assistant"]
    if any(want not in got for want, got in zip(wanted, answers)):
        return [f"data.tokenizer {tokenizer.name_or_path}: its chat template's assistant turns of a probe conversation "
                f"hold the targets {answers!r}, which do not contain the answers {wanted!r}"]
    return []
