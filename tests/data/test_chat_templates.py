"""Chat templates judged by what they render: loss masks equal transformers' ``assistant_masks`` on the
templates of several families (Llama 3, Qwen2.5 ChatML, Qwen3 with reasoning removal, Mistral
``[INST]``, plain role names), with two tokenizers built offline; a template without marks gets the
mask marks around its whole turns would give; a token merge at a turn's edge changes nothing; text after
``{% endgeneration %}`` is no target; templates without marks that rewrite earlier turns are refused
by the launcher's check and its dry run, with marks they are trained as rendered once."""

from __future__ import annotations

import pytest

from tests.chat_template_cases import (
    ALL_CONVERSATIONS,
    CASES,
    LLAMA3,
    MISTRAL,
    PLAIN,
    QWEN3,
    REASONING,
    TemplateCase,
    byte_level_bpe,
    chatml,
    metaspace_bpe,
    with_template,
    without_marks,
)
from tests.chat_utils import REPO, VOCAB, chat_loader, openai_line, write_jsonl
from veomni import launch
from veomni.config.schema import DataConfig
from veomni.data.chat.conversation import TemplateChat
from veomni.data.chat.template_probe import chat_template_problems
from veomni.data.kinds import get_dataset_kind
from veomni.data.sources import InvalidSampleError
from veomni.tasks.base import IGNORE_INDEX

TOKENIZERS = {"byte-level": byte_level_bpe, "metaspace": metaspace_bpe}


class _Model:
    vocab_size = VOCAB


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def base(request):
    return TOKENIZERS[request.param]()


def _reference(tokenizer, messages) -> tuple[list[int], list[bool]]:
    """transformers' own ids and ``assistant_masks`` (the template must have marks)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def _ours(tokenizer, messages) -> tuple[list[int], list[bool]]:
    chat = TemplateChat(tokenizer).encode(messages, "test")
    return chat.ids, chat.targets


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_masks_equal_transformers_assistant_masks(base, case: TemplateCase):
    tokenizer = with_template(base, case.marked)
    for messages in ALL_CONVERSATIONS:
        assert _ours(tokenizer, messages) == _reference(tokenizer, messages), messages


@pytest.mark.parametrize("case", [c for c in CASES if c.whole_turn_marked], ids=lambda c: c.name)
def test_a_template_without_marks_masks_its_whole_assistant_turns(base, case: TemplateCase):
    """Without marks the span runs from the generation prompt to the next turn: transformers' mask of
    the template marked there, on every conversation the template does not rewrite."""
    marked, unmarked = with_template(base, case.marked), with_template(base, case.unmarked)
    kept = [m for m in ALL_CONVERSATIONS if not case.rewritten(m)]
    assert len(kept) >= 5
    for messages in kept:
        assert _ours(unmarked, messages) == _reference(marked, messages), messages


def test_text_after_endgeneration_is_no_target(base):
    """Qwen's marks close before the turn's newline: ``<|im_end|>`` is a target, the newline after it is not."""
    tokenizer = with_template(base, chatml(newline_marked=False))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for messages in ALL_CONVERSATIONS:
        ids, targets = _ours(tokenizer, messages)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        ends = [i for i, t in enumerate(ids) if t == end and targets[i]]
        assert len(ends) == sum(m["role"] == "assistant" for m in messages)
        assert [text[slice(*offsets[i + 1])] for i in ends] == ["\n"] * len(ends)
        assert not any(targets[i + 1] for i in ends)


def test_a_token_straddling_the_answer_start_is_a_target(base):
    """``Assistant: `` ends in a space the answer's first token takes (`` 9`` / ``▁9``): that token is a target,
    so every character of the answer is."""
    tokenizer = with_template(base, without_marks(PLAIN))
    messages = ALL_CONVERSATIONS[0]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    _, targets = _ours(tokenizer, messages)
    start, end = offsets[targets.index(True)]
    assert text[:start + 1].endswith("Assistant: ") and text[start:end] == " 9"


def test_a_llama3_generation_prompt_merged_at_the_string_end_passes_the_launch_check(tmp_path):
    """The byte-level tokenizer merges the prompt's trailing ``\\n\\n`` into one token alone but not before
    the answer; the template rewrites nothing, so the check passes and the mask is the whole turn's."""
    tokenizer = with_template(byte_level_bpe(), without_marks(LLAMA3))
    alone = tokenizer.encode("<|end_header_id|>\n\n", add_special_tokens=False)
    before = tokenizer.encode("<|end_header_id|>\n\nHi", add_special_tokens=False)
    assert before[:len(alone)] != alone  # the artefact the check must not judge by
    assert _check(tmp_path, tokenizer) == []


def _check(tmp_path, tokenizer) -> list[str]:
    """The launcher's check of the chat_text kind, on ``tokenizer`` saved as a folder."""
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(str(folder))
    path = write_jsonl(tmp_path / "c.jsonl", [openai_line(m) for m in ALL_CONVERSATIONS])
    cfg = DataConfig(kind="chat_text", train_path=str(path), tokenizer=str(folder), text_key="json")
    return get_dataset_kind("chat_text").check(cfg, _Model())


REWRITING = {"qwen3 without marks": (without_marks(QWEN3), "reasoning blocks", "drops earlier reasoning"),
             "mistral without marks": (without_marks(MISTRAL), "a system turn", "moves the system prompt")}


@pytest.mark.parametrize("name", sorted(REWRITING))
def test_templates_without_marks_that_rewrite_earlier_turns_are_refused_at_launch(tmp_path, name):
    template, probe, cause = REWRITING[name]
    (problem,) = _check(tmp_path, with_template(byte_level_bpe(), template))
    assert f"probe conversation with {probe}" in problem and "differently from the whole conversation" in problem
    assert cause in problem and "{% generation %}" in problem and "return_assistant_tokens_mask" in problem


def test_the_dry_run_refuses_a_rewriting_template_and_passes_llama3(tmp_path, capsys):
    path = write_jsonl(tmp_path / "c.jsonl", [openai_line(m) for m in ALL_CONVERSATIONS])
    codes = {}
    for name, template in {"qwen3": without_marks(QWEN3), "llama3": without_marks(LLAMA3)}.items():
        folder = tmp_path / name
        with_template(byte_level_bpe(), template).save_pretrained(str(folder))
        codes[name] = launch.main([str(REPO / "recipes" / "chat" / "tiny_chat_sft.yaml"), "--dry-run",
                                   "--data.train_path", str(path), "--data.eval_path", str(path),
                                   "--data.prepare", "null", "--data.tokenizer", str(folder)])
        codes[name, "stderr"] = capsys.readouterr().err
    assert codes["llama3"] == 0, codes["llama3", "stderr"]
    assert codes["qwen3"] == 2 and "drops earlier reasoning" in codes["qwen3", "stderr"]


@pytest.mark.parametrize("template", [QWEN3, MISTRAL], ids=["qwen3", "mistral"])
def test_marked_rewriting_templates_pass_the_launch_check_and_train_as_rendered_once(tmp_path, template):
    tokenizer = with_template(byte_level_bpe(), template)
    assert _check(tmp_path, tokenizer) == []
    rows = list(chat_loader(tmp_path / "c.jsonl", tmp_path / "tokenizer", max_seq_len=512))
    bounds = [(row, a, b) for row in rows for a, b in zip(row["cu_seqlens"].tolist(), row["cu_seqlens"].tolist()[1:])]
    assert len(bounds) == len(ALL_CONVERSATIONS)
    for (row, a, b), messages in zip(bounds, ALL_CONVERSATIONS):
        predicted = [False] + (row["labels"][a:b - 1] != IGNORE_INDEX).tolist()
        assert (row["input_ids"][a:b].tolist(), predicted) == _reference(tokenizer, messages)


def test_a_cut_conversation_is_rendered_on_its_own(tmp_path):
    """Qwen3 keeps the reasoning of the last answer: a conversation cut after its second answer keeps
    that answer's reasoning, which the whole conversation's rendering had dropped."""
    tokenizer = with_template(byte_level_bpe(), QWEN3)
    messages = REASONING[1]
    two = _reference(tokenizer, messages[:5])
    whole = _reference(tokenizer, messages)
    assert whole[0][:len(two[0])] != two[0]
    chat = TemplateChat(tokenizer).fit(messages, "test", len(two[0]))
    assert (chat.ids, chat.targets) == two
    assert "Again." in tokenizer.decode([t for t, target in zip(chat.ids, chat.targets) if target])
    with pytest.raises(InvalidSampleError, match="past data.max_seq_len=5"):
        TemplateChat(tokenizer).fit(messages, "test", 5)


BAD_MARKS = {
    "only the last turn": (LLAMA3.replace("{% if m['role'] == 'assistant' %}",
                                          "{% if m['role'] == 'assistant' and loop.last %}"), "do not hold the answer"),
    "user turns too": (LLAMA3.replace("{% else %}{{ m['content'] | trim + '<|eot_id|>' }}",
                                      "{% else %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}"
                                      "{% endgeneration %}"), "hold the user text"),
}


@pytest.mark.parametrize("name", sorted(BAD_MARKS))
def test_marks_that_miss_an_answer_or_hold_a_prompt_are_refused(tmp_path, name):
    template, why = BAD_MARKS[name]
    (problem,) = _check(tmp_path, with_template(byte_level_bpe(), template))
    assert why in problem and "{% generation %} marks" in problem


def test_a_probe_the_template_refuses_is_not_judged_unless_it_is_the_plain_one(tmp_path):
    """Mistral v0.1 raises on a system turn: such samples are counted bad at load, the template passes;
    a template that refuses the plain two-exchange probe is refused, with its reason."""
    no_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}" + LLAMA3
    assert _check(tmp_path / "no_system", with_template(byte_level_bpe(), no_system)) == []
    (problem,) = _check(tmp_path / "none", with_template(byte_level_bpe(), "{{ raise_exception('no chats') }}"))
    assert "probe conversation with two exchanges" in problem and "refused the conversation" in problem
    assert "no chats" in problem


def test_a_slow_tokenizer_is_refused_for_want_of_character_offsets():
    from transformers import ByT5Tokenizer  # a Python tokenizer that needs no files

    slow = with_template(ByT5Tokenizer(), LLAMA3)
    (problem,) = chat_template_problems(slow)
    assert "Python (slow) tokenizer" in problem and "tokenizer.json" in problem
    with pytest.raises(ValueError, match="no character offsets"):
        TemplateChat(slow)


def test_named_templates_without_a_default_are_refused_naming_the_folder():
    tokenizer = with_template(byte_level_bpe(), {"tool_use": LLAMA3})
    (problem,) = chat_template_problems(tokenizer)
    assert problem.startswith(f"data.tokenizer {tokenizer.name_or_path}: ") and "tool_use" in problem
