"""The launcher's check of a chat template: render probe conversations, refuse what cannot give loss masks.

Why probes of several shapes: a template's faults show only on the turns that trigger them. One
that moves the system prompt into the last user turn needs a system turn and several exchanges
to show it; one that drops earlier reasoning needs ``<think>`` blocks in earlier answers. Each
probe is encoded as a sample would be (``TemplateChat.encode``), so a template without
``{% generation %}`` marks that rewrites earlier turns is refused here, before any worker starts,
not found later when every sample is skipped. The targets must then hold every answer (the text
after a reasoning block, which a template may drop from earlier turns) and no system or user
text. A probe the template itself refuses (one that raises on a system turn, say) is not judged:
samples of that shape are counted bad at load, with the template's reason; the plain two-exchange
probe must render.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from veomni.data.chat.conversation import (
    MARK_THE_TEMPLATE,
    TemplateChat,
    TemplateRefusal,
    missing_template,
    slow_tokenizer,
)
from veomni.data.sources import InvalidSampleError

if TYPE_CHECKING:  # transformers loads in a second; only text datasets need it
    from transformers import PreTrainedTokenizerBase


def _turns(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in pairs]


PROBES = {
    "two exchanges": _turns(("user", "Name a colour."), ("assistant", "Blue."),
                            ("user", "Another one, please."), ("assistant", "Green.")),
    "a system turn and three exchanges": _turns(
        ("system", "Answer in one word."), ("user", "Name a colour."), ("assistant", "Blue."),
        ("user", "Another one, please."), ("assistant", "Green."), ("user", "And a third?"), ("assistant", "Red.")),
    "reasoning blocks in three exchanges": _turns(
        ("user", "Name a colour."), ("assistant", "<think>\nPick the sky's.\n</think>\n\nBlue."),
        ("user", "Another one, please."), ("assistant", "<think>\nPick the grass's.\n</think>\n\nGreen."),
        ("user", "And a third?"), ("assistant", "<think>\nPick a rose's.\n</think>\n\nRed.")),
}
"""Conversations the launcher renders, by what they hold; the first must render."""


def answer_of(content: str) -> str:
    """The answer an assistant turn gives: its content after any reasoning block."""
    return content.split("</think>")[-1].strip()


def chat_template_problems(tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The launcher's check of a tokenizer's template (see the module docstring)."""
    problem = missing_template(tokenizer) or slow_tokenizer(tokenizer)
    if problem:
        return [problem]
    try:
        chat = TemplateChat(tokenizer)
    except ValueError as error:  # named templates, none of them the default
        return [f"data.tokenizer {tokenizer.name_or_path}: {error}"]
    for index, (shape, messages) in enumerate(PROBES.items()):
        where = f"data.tokenizer {tokenizer.name_or_path}: its chat template, on a probe conversation with {shape}"
        try:
            tokens = chat.encode(messages, "probe")
        except TemplateRefusal as error:
            if index:
                continue
            return [f"{where}: {error}"]
        except InvalidSampleError as error:
            return [f"{where}: {error}"]
        problem = target_problem(tokenizer, tokens.ids, tokens.targets, messages, chat.marked)
        if problem:
            return [f"{where}: {problem}"]
    return []


def target_problem(tokenizer: PreTrainedTokenizerBase, ids: list[int], targets: list[bool],
                   messages: list[dict[str, str]], marked: bool) -> str:
    """Why the targets of a rendered conversation are wrong (an answer missing, a prompt trained on); empty if
    they hold every answer, in order, and no system or user text."""
    runs, run = [], []
    for token, target in zip(ids, targets):
        if target:
            run.append(token)
        elif run:
            runs.append(tokenizer.decode(run))
            run = []
    runs += [tokenizer.decode(run)] if run else []
    joined, cursor = "\0".join(runs), 0
    for answer in (answer_of(m["content"]) for m in messages if m["role"] == "assistant"):
        found = joined.find(answer, cursor)
        if found < 0:
            fix = ("its {% generation %} marks must wrap every assistant turn's answer" if marked else
                   "the text between the generation prompt and the next turn must hold the answer")
            return f"the loss targets {runs!r} do not hold the answer {answer!r} ({fix})"
        cursor = found + len(answer)
    prompt = next((m for m in messages if m["role"] != "assistant" and m["content"] in joined), None)
    if prompt is not None:
        fix = ("its {% generation %} marks must wrap assistant text only" if marked else
               f"its generation prompt must end where the answer starts; or {MARK_THE_TEMPLATE}")
        return f"the loss targets {runs!r} hold the {prompt['role']} text {prompt['content']!r} ({fix})"
    return ""
