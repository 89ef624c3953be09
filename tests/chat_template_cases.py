"""Chat templates of the families users bring, written small, and two tokenizers built offline to render
them with, for the chat-template tests (``tests/data/test_chat_templates.py``).

Each template is written with ``{% generation %}`` marks, so transformers' own
``return_assistant_tokens_mask`` gives a loss mask the code under test did not compute; the same
template with its marks stripped is what a user without marks brings. The tokenizers: the bundled
byte-level BPE (GPT-2 style pre-tokenizer: it merges a trailing ``\\n\\n`` into one token at the end of
a string but not before a word) and a Metaspace BPE (sentencepiece style, as Llama-2 and Mistral
tokenizers: a word's token covers the space before it) trained here on the test texts.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

from tests.chat_utils import CONVERSATIONS, REPO
from veomni.data.chat.template_probe import PROBES

SPECIAL = ["<s>", "</s>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|im_start|>", "<|im_end|>", "[INST]", "[/INST]"]
"""Every family's special tokens, in one tokenizer (``<s>`` / ``</s>`` are its bos / eos)."""

LLAMA3 = (
    "{{ '<|begin_of_text|>' }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
"""Llama 3: the generation prompt ends in ``\\n\\n``, which a tokenizer may merge at the end of a string."""


def chatml(newline_marked: bool) -> str:
    """Qwen2.5's ChatML: a default system turn; the marks end before the turn's newline (as Qwen's own
    templates would place them) or after it."""
    answer = "m['content'] + '<|im_end|>\\n'" if newline_marked else "m['content'] + '<|im_end|>'"
    after = "" if newline_marked else "{{ '\\n' }}"
    return (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
        "{% generation %}{{ " + answer + " }}{% endgeneration %}" + after +
        "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )


QWEN3 = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% set answer = m['content'].split('</think>')[-1].lstrip('\\n') %}"
    "{% set reasoning = m['content'].split('</think>')[0].split('<think>')[-1].strip('\\n') "
    "if '</think>' in m['content'] else '' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}"
    "{% if reasoning and loop.index0 > ns.last_user %}{{ '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{% endif %}"
    "{{ answer + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""Qwen3: an answer's reasoning block is kept only after the last user turn, so once another user turn
follows, the earlier turn is rendered without it."""

MISTRAL = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in turns %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{{ bos_token }}{% for m in turns %}{% if m['role'] == 'user' %}"
    "{{ '[INST] ' + (system + '\\n\\n' if system and loop.index0 == ns.last_user else '') + m['content'] }}"
    "{{ ' [/INST]' }}{% else %}{% generation %}{{ ' ' + m['content'] + eos_token }}{% endgeneration %}"
    "{% endif %}{% endfor %}"
)
"""Mistral v3: ``[INST]`` turns, no generation prompt, the system prompt written into the last user turn."""

PLAIN = (
    "{% for m in messages %}{{ m['role'] | capitalize + ': ' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + '\\n' }}{% endgeneration %}"
    "{% else %}{{ m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)
"""Role names and a generation prompt that ends in a space, which the answer's first token takes."""


@dataclass(frozen=True)
class TemplateCase:
    name: str
    marked: str
    rewrites: str = ""
    """What makes the template render earlier turns differently once later ones follow: ``system`` (a
    system turn), ``reasoning`` (a reasoning block), or nothing."""
    whole_turn_marked: bool = True
    """The marks run from the generation prompt to the next turn (the span a template without marks gets)."""

    @property
    def unmarked(self) -> str:
        return without_marks(self.marked)

    def rewritten(self, messages: list[dict[str, str]]) -> bool:
        """Whether ``messages`` hold what makes this template rewrite an earlier turn."""
        answers = sum(m["role"] == "assistant" for m in messages)
        return (self.rewrites == "system" and messages[0]["role"] == "system" and answers > 1
                or self.rewrites == "reasoning" and any("</think>" in m["content"] for m in messages))


GENERATION_TAG = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")


def without_marks(template: str) -> str:
    """``template`` as a user without ``{% generation %}`` marks has it."""
    return GENERATION_TAG.sub("", template)

CASES = [TemplateCase("llama3", LLAMA3), TemplateCase("qwen2.5", chatml(False), whole_turn_marked=False),
         TemplateCase("chatml-turn-marked", chatml(True)), TemplateCase("qwen3", QWEN3, "reasoning", False),
         TemplateCase("mistral", MISTRAL, "system"), TemplateCase("plain", PLAIN)]

REASONING = [
    [{"role": "user", "content": "7 2 9"},
     {"role": "assistant", "content": "<think>\nReverse them.\n</think>\n\n9 2 7"}],
    [{"role": "system", "content": "Sort the digits."}, {"role": "user", "content": "5 1 4"},
     {"role": "assistant", "content": "<think>\nSmallest first.\n</think>\n\n1 4 5"},
     {"role": "user", "content": "3 0"}, {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n0 3"},
     {"role": "user", "content": "9 6"}, {"role": "assistant", "content": "<think>\nOnce more.\n</think>\n\n6 9"}],
]
"""Conversations with reasoning blocks, one of several exchanges after a system turn."""

ALL_CONVERSATIONS = CONVERSATIONS + REASONING


def byte_level_bpe():
    """The bundled byte-level BPE with every family's special tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "data" / "tokenizers" / "stdlib-bpe-8k"),
                                              local_files_only=True)
    tokenizer.add_special_tokens({"bos_token": "<s>", "eos_token": "</s>", "additional_special_tokens": SPECIAL})
    return tokenizer


def metaspace_bpe():
    """A sentencepiece-style BPE trained here on every text the tests render (so no character is unknown)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    texts = [m["content"] for c in ALL_CONVERSATIONS + list(PROBES.values()) for m in c]
    texts += ["System: User: Assistant: You are a helpful assistant.", "system user assistant <think> </think>"]
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", *SPECIAL],
                                                           show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=SPECIAL[2:])


def with_template(tokenizer, template: str):
    """A copy of ``tokenizer`` (sharing its backend) that renders with ``template``."""
    out = copy.copy(tokenizer)
    out.chat_template = template
    return out
