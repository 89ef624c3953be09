"""Chat samples -> token ids with loss targets and expanded media placeholders.

Template (``PLAIN``: plain text, so any tokenizer works)::

    User: <image>\nWhat color is the shape?\n
    Assistant: red<eos>

Each message is ``"{Role}: "`` + content; user/system turns end with a newline, assistant turns
with the tokenizer's eos. Only the assistant's content and its eos are targets. A model family
may declare its own markup (a ``ChatMarkup``: Qwen-VL's ``<|im_start|>user\n...<|im_end|>\n``),
which a recipe picks with ``data.chat_markup: model``; its answers end with its own end token,
a target as the eos is, and its special tokens are added and checked like the layout's. Every media
marker (``<image>``) in the content is replaced by ``num_tokens`` copies of that modality's
placeholder token, one per feature the encoder will produce, so the model can write the
features over them in order. The placeholder is the marker itself unless the model's
``MediaLayout`` names another (Qwen-VL: ``<|vision_start|>`` + ``<|image_pad|>`` per feature +
``<|vision_end|>``). The layout's tokens are added to the tokenizer as special tokens, after its
own vocabulary (tokens the tokenizer has keep their ids), in the layout's order.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenizers import AddedToken

from veomni.contract.media import ChatMarkup, MediaLayout
from veomni.data.sources import InvalidSampleError
from veomni.errors import BadConfig, BadData

if TYPE_CHECKING:  # transformers loads in a second; only text datasets need it
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant")
PLAIN = ChatMarkup(header="{Role}: ", turn_end="\n")
"""The engine's template (``data.chat_markup: plain``)."""


def add_placeholder_tokens(tokenizer: PreTrainedTokenizerBase, markers: Sequence[str]) -> dict[str, int]:
    """Add each marker as a special token (once; later calls find it) -> marker: token id."""
    tokenizer.add_tokens(
        [AddedToken(m, special=True, normalized=False) for m in markers], special_tokens=True
    )
    return {m: tokenizer.convert_tokens_to_ids(m) for m in markers}


def layout_token_problems(tokenizer: PreTrainedTokenizerBase, layout: MediaLayout,
                          markup: ChatMarkup = PLAIN) -> list[str]:
    """Add the layout's tokens, then the markup's; name each whose id differs from the one the
    model config fixes."""
    got = add_placeholder_tokens(tokenizer, [*layout.tokens(), *markup.tokens()])
    return [f"the tokenizer gives {token} id {got[token]}, the model config expects {want}: set the model's id "
            f"to {got[token]} (or use a tokenizer that has it at {want})"
            for token, want in {**layout.token_ids, **markup.token_ids}.items() if got[token] != want]


def chat_markup(model_config, choice: str) -> ChatMarkup:
    """The markup ``data.chat_markup`` picks: ``plain`` (``PLAIN``) or ``model`` (the family's own;
    ValueError when it declares none)."""
    if choice == "plain":
        return PLAIN
    markup = model_config.chat_markup() if choice == "model" else None
    if markup is None:
        raise BadConfig(f"data.chat_markup={choice!r}: expected 'plain', or 'model' for a model family that "
                        f"declares its chat markup ({type(model_config).__name__} declares none)")
    return markup


@dataclass
class EncodedChat:
    """One sample's tokens. ``targets[i]``: token i is a loss target; ``placeholders[name]``: the
    positions of that modality's placeholder tokens, in order."""

    ids: list[int] = field(default_factory=list)
    targets: list[bool] = field(default_factory=list)
    placeholders: dict[str, list[int]] = field(default_factory=dict)

    def extend(self, ids: Sequence[int], target: bool) -> None:
        self.ids.extend(ids)
        self.targets.extend([target] * len(ids))


class ChatEncoder:
    """Turns ``messages`` (+ the number of features of each media item) into an ``EncodedChat``."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, markers: Mapping[str, str],
                 layout: MediaLayout | None = None, markup: ChatMarkup = PLAIN) -> None:
        """``markers``: modality name -> its marker in the text (``{"image": "<image>"}``); ``layout``:
        the model's tokens for an item (default: the marker, once per feature); ``markup``: how turns
        are written. ValueError when the tokenizer gives a token the model fixes another id."""
        self.tokenizer = tokenizer
        self.modality_of = {marker: name for name, marker in markers.items()}
        self.layout = layout or MediaLayout(pad=dict(markers))
        self.markup = markup
        problems = layout_token_problems(tokenizer, self.layout, markup)
        if problems:
            raise BadData("; ".join(problems))
        ids = add_placeholder_tokens(tokenizer, self.layout.tokens())
        # the ids closing an answer (targets); its last one is where a generated answer stops
        self.answer_end = [tokenizer.eos_token_id] if markup.answer_end is None else self._text(markup.answer_end)
        self.token_of = {marker: ids[self.layout.pad[name]] for name, marker in markers.items()}
        self.around = tuple([ids[t]] if t else [] for t in (self.layout.start, self.layout.end))
        self.split = (
            re.compile("(" + "|".join(re.escape(m) for m in markers.values()) + ")") if markers else None
        )

    def _text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _header(self, role: str) -> list[int]:
        return self._text(self.markup.header.format(role=role, Role=role.capitalize()))

    def encode(
        self,
        messages: Sequence[Mapping[str, str]],
        media_tokens: Mapping[str, Sequence[int]],
        key: str,
        add_generation_prompt: bool = False,
    ) -> EncodedChat:
        """``media_tokens[name][j]``: features of the sample's j-th item of modality ``name``.

        With ``add_generation_prompt`` the final assistant turn is left out and its header kept
        (a prompt to decode from). Raises ``InvalidSampleError`` naming ``key`` when the markers
        and the media items do not pair up one to one.
        """
        out = EncodedChat(placeholders={name: [] for name in media_tokens})
        used = {name: 0 for name in media_tokens}
        turns = list(messages)
        if add_generation_prompt and turns and turns[-1].get("role") == "assistant":
            turns = turns[:-1]
        if self.markup.default_system is not None and not (turns and turns[0].get("role") == "system"):
            turns.insert(0, {"role": "system", "content": self.markup.default_system})
        for turn in turns:
            role, content = turn.get("role"), turn.get("content")
            if role not in ROLES or not isinstance(content, str):
                raise InvalidSampleError(
                    f"sample {key!r}: each message needs a role in {ROLES} and a string "
                    f"content, got {dict(turn)!r}"
                )
            out.extend(self._header(role), False)
            if role == "assistant":
                out.extend(self._text(content) + self.answer_end, True)
                out.extend(self._text(self.markup.after_answer), False)
                continue
            for piece in self.split.split(content) if self.split else [content]:
                name = self.modality_of.get(piece)
                if name is None:
                    out.extend(self._text(piece), False)
                    continue
                items = media_tokens.get(name, ())
                if used.get(name, 0) >= len(items):
                    raise InvalidSampleError(
                        f"sample {key!r}: more {piece} placeholders than {name} items "
                        f"({len(items)}); every placeholder needs its own item"
                    )
                count = items[used[name]]
                used[name] += 1
                out.extend(self.around[0], False)
                out.placeholders[name].extend(range(len(out.ids), len(out.ids) + count))
                out.extend([self.token_of[piece]] * count, False)
                out.extend(self.around[1], False)
            out.extend(self._text(self.markup.turn_end), False)
        if add_generation_prompt:
            out.extend(self._header("assistant"), False)
        for name, items in media_tokens.items():
            if used[name] != len(items):
                raise InvalidSampleError(
                    f"sample {key!r}: {len(items)} {name} item(s) but {used[name]} placeholder(s) "
                    "in the text; add one placeholder per item"
                )
        return out
