"""Malformed recipes fail in the launcher, in a dry run exactly as in a real run: exit 2 with a
``config error:`` naming the key (and where it was set), no traceback, before any worker starts.
Absent data or tokenizer folders are the exception: a dry run plans without them and names them."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.launch.test_launch import train_sh
from tests.trainer_utils import TOKENIZER, write_corpus
from veomni import launch

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

BASE = """\
model:
  arch: llm
  family: qwen3
  vocab_size: 8192
  hidden_size: 32
  intermediate_size: 64
  num_layers: 2
  num_heads: 4
  num_kv_heads: 2
  head_dim: 8
  max_position_embeddings: 256
data:
  train_path: corpus/train
  eval_path: corpus/eval
  format: jsonl
  text_key: text
  tokenizer: {tokenizer}
  max_seq_len: 64
  tokens_per_micro_batch: 128
parallel:
  dp_shard: -1
train:
  output_dir: out
  max_steps: 2
  lr: 3.0e-3
  warmup_steps: 1
checkpoint:
  keep_last: 2
log:
  interval: 1
"""


def _replace(old: str, new: str):
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)
    return edit


def _whole(new: str):
    return lambda text: new


def _line(key_line: str) -> int:
    return BASE.splitlines().index(key_line) + 1


CASES = [
    # (id, edit of the recipe text, CLI overrides, regex the error must match)
    ("unknown-section", _replace("train:\n", "trian:\n"), [],
     r"r\.yaml:\d+: unknown section 'trian'; did you mean 'train'"),
    ("learning-rate", _replace("  lr: 3.0e-3", "  learning_rate: 3.0e-3"), [],
     r"unknown key 'train\.learning_rate'; did you mean 'train\.lr'"),
    ("fsdp", _replace("  dp_shard: -1", "  fsdp: 2"), [],
     r"unknown key 'parallel\.fsdp'; did you mean 'parallel\.dp_shard'"),
    ("fsdp-size", [], ["--parallel.fsdp_size", "2"],
     r"unknown key 'parallel\.fsdp_size'; did you mean 'parallel\.dp_shard'"),
    ("tp", [], ["--parallel.tp", "2"], r"unknown key 'parallel\.tp'; tensor parallelism is not"),
    ("batch-size", _replace("  max_steps: 2", "  max_steps: 2\n  batch_size: 8"), [],
     r"unknown key 'train\.batch_size'; did you mean 'data\.tokens_per_micro_batch'"),
    ("grad-accum-steps", [], ["--train.gradient_accumulation_steps", "4"],
     r"unknown key 'train\.gradient_accumulation_steps'; did you mean 'train\.grad_accum'"),
    ("max-step", [], ["--train.max_step", "3"], r"did you mean 'train\.max_steps'"),
    ("wrong-section", [], ["--train.max_seq_len", "64"],
     r"unknown key 'train\.max_seq_len'; did you mean 'data\.max_seq_len'"),
    ("hf-model-name", [], ["--model.num_hidden_layers", "2"],
     r"unknown key 'model\.num_hidden_layers' .*did you mean 'model\.num_layers'"),
    ("wrong-type", _replace("  lr: 3.0e-3", "  lr: fast"), [], r"train\.lr: expected a number, got 'fast'"),
    ("zero-steps", [], ["--train.max_steps", "0"], r"train\.max_steps must be >= 1"),
    ("negative-warmup", [], ["--train.warmup_steps", "-1"], r"train\.warmup_steps must be >= 0"),
    ("min-lr-ratio", [], ["--train.min_lr_ratio", "2"], r"train\.min_lr_ratio must be in \[0, 1\]"),
    ("keep-last", [], ["--checkpoint.keep_last", "0"], r"checkpoint\.keep_last must be >= 1"),
    ("num-workers", [], ["--data.num_workers", "-1"], r"data\.num_workers must be >= 0"),
    ("micro-batch", [], ["--data.tokens_per_micro_batch", "0"], r"data\.tokens_per_micro_batch must be >= 1"),
    ("log-interval-type", [], ["--log.interval", "often"], r"log\.interval: expected an int"),
    ("duplicate-key", _replace("  lr: 3.0e-3", "  lr: 3.0e-3\n  lr: 1.0e-3"), [],
     r"r\.yaml:\d+: key 'lr' is given twice in one mapping \(lines \d+ and \d+\)"),
    ("duplicate-section", lambda t: t + "train:\n  max_steps: 5\n", [],
     r"r\.yaml:\d+: key 'train' is given twice in one mapping \(lines \d+ and \d+\)"),
    ("duplicate-model-key", _replace("  num_layers: 2", "  num_layers: 2\n  num_layers: 3"), [],
     r"key 'num_layers' is given twice"),
    ("empty-file", _whole(""), [], r"r\.yaml: the recipe is empty"),
    ("comments-only", _whole("# nothing here\n"), [], r"r\.yaml: the recipe is empty"),
    ("top-level-list", _whole("- model\n- data\n"), [], r"r\.yaml: the top level must be a mapping of sections"),
    ("invalid-yaml", _replace("  lr: 3.0e-3", "  lr: [3.0e-3"), [], r"r\.yaml: not valid YAML"),
    ("section-scalar", _replace("log:\n  interval: 1\n", "log: 5\n"), [], r"section 'log' must be a mapping"),
    ("nested-too-deep", _replace("  lr: 3.0e-3", "  lr:\n    value: 1"), [], r"'train\.lr\.value' is nested too deep"),
    ("unknown-arch", _replace("  arch: llm", "  arch: gpt5"), [], r"r\.yaml:\d+: .*gpt5"),
    ("unknown-model-key", _replace("  hidden_size: 32", "  hidden_sise: 32"), [],
     r"unknown key 'model\.hidden_sise' .*did you mean 'model\.hidden_size'"),
    ("bad-kv-heads", [], ["--model.num_kv_heads", "3"], r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    ("bad-family", _replace("  family: qwen3", "  family: gpt"), [], r"r\.yaml:\d+: .*family must be one of"),
    ("bad-rope-scaling", [], ["--model.rope_scaling", "{rope_type: bogus, factor: 2.0}"], r"rope_scaling"),
    ("negative-positions", [], ["--model.max_position_embeddings", "-5"], r"max_position_embeddings"),
    ("seq-over-positions", [], ["--data.max_seq_len", "512", "--data.tokens_per_micro_batch", "512"],
     r"data\.max_seq_len \(512\) exceeds model\.max_position_embeddings \(256\)"),
    ("small-vocab", [], ["--model.vocab_size", "1000"], r"model\.vocab_size=1000 is smaller than the tokenizer's"),
    ("no-train-path", [], ["--data.train_path", "''"], r"data\.train_path is not set"),
    ("missing-prepare", [], ["--data.train_path", "/nonexistent/x", "--data.prepare", "/nonexistent/build.py"],
     r"data\.prepare: script not found"),
    ("unknown-kind", [], ["--data.kind", "nonsense"], r"data\.kind"),
    ("source-negative-weight", [], ["--data.train_path", "''", "--data.sources",
                                    "[{path: corpus/train, weight: -0.5, name: code}]"],
     r"data\.sources\[0\] \('code'\): weight -0\.5 is negative"),
    ("source-weights-zero", [], ["--data.train_path", "''", "--data.sources", "[{path: corpus/train, weight: 0}]"],
     r"data\.sources: the weights .* sum to zero"),
    ("source-unknown-key", [], ["--data.train_path", "''", "--data.sources", "[{path: corpus/train, wieght: 1}]"],
     r"unknown key 'data\.sources\[0\]\.wieght'.*weight"),
    ("sources-and-train-path", [], ["--data.sources", "[{path: corpus/train}]"],
     r"data\.train_path and data\.sources are both set"),
    ("balance-group", [], ["--data.balance", "true", "--data.balance_group", "3"],
     r"data\.balance_group=3 must divide the data-parallel size"),
    ("indivisible", [], ["--parallel.dp_replicate", "3"], r"dp_replicate=3 does not divide the world size"),
    ("sample-writer", [], ["--train.sample_interval", "10"], r"train\.sample_interval=10: model family 'llm'"),
    ("missing-init-from-hf", [], ["--checkpoint.init_from_hf", "/nonexistent/qwen3"],
     r"checkpoint\.init_from_hf: folder does not exist: /nonexistent/qwen3"),
    ("empty-init-folder", [], ["--checkpoint.init_from_hf", "corpus"], r"checkpoint\.init_from_hf: .*holds neither"),
    ("init-unknown-module", [], ["--checkpoint.init.vision", "corpus"], r"checkpoint\.init\.vision: the model has no"),
    ("bad-override-flag", [], ["train.lr", "1"], r"unexpected argument 'train\.lr'"),
    # fine-tuning recipes: LoRA, chat, a pretrained folder (the plan checks what the launch checks)
    ("lora-rank-zero", [], ["--lora.targets", "[q_proj]"], r"lora\.targets is set but lora\.rank is 0"),
    ("lora-target-matches-nothing", [], ["--lora.rank", "4", "--lora.targets", "[nonexistent_proj]"],
     r"lora\.targets.*nonexistent_proj"),
    ("lora-missing-init-from-hf", [], ["--lora.rank", "4", "--checkpoint.init_from_hf", "/nonexistent/qwen3"],
     r"checkpoint\.init_from_hf: folder does not exist: /nonexistent/qwen3"),
    ("chat-lora-empty-init-folder", [], ["--data.kind", "chat_text", "--lora.rank", "4", "--checkpoint.init_from_hf",
                                         "corpus"], r"checkpoint\.init_from_hf: .*holds neither"),
]


ABSENT = [
    # (id, the key, CLI overrides, regex of the real run's refusal): inputs a dry run plans without
    ("missing-train-path", "data.train_path", ["--data.train_path", "/nonexistent/shards"],
     r"data\.train_path: path does not exist: /nonexistent/shards"),
    ("missing-eval-path", "data.eval_path", ["--data.eval_path", "/nonexistent/eval"],
     r"data\.eval_path: path does not exist"),
    ("missing-tokenizer", "data.tokenizer", ["--data.tokenizer", "/nonexistent/tokenizer"],
     r"data\.tokenizer: path does not exist: /nonexistent/tokenizer"),
    ("source-missing", "data.sources[0] ('web')",
     ["--data.train_path", "''", "--data.sources", "[{path: /nonexistent/web, name: web}]"],
     r"data\.sources\[0\] \('web'\): path does not exist"),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bad_recipes")
    write_corpus(folder / "corpus" / "train", documents=20, seed=0)
    write_corpus(folder / "corpus" / "eval", documents=4, seed=1)
    return folder


def launch_both_modes(recipe: Path, overrides: list[str], capsys) -> list[tuple[int, str]]:
    """``[(exit status, stdout + stderr)]`` of the launcher, in process: a dry run, then a real run."""
    results = []
    for mode in (["--dry-run"], []):
        start = time.monotonic()
        status = launch.main([str(recipe), *mode, *overrides])
        captured = capsys.readouterr()
        assert time.monotonic() - start < 20, "the launcher's checks take seconds"
        results.append((status, captured.out + captured.err))
    return results


def _recipe(workdir: Path, edit) -> Path:
    text = BASE.format(tokenizer=TOKENIZER)
    recipe = workdir / "r.yaml"
    recipe.write_text(edit(text) if callable(edit) else text)
    return recipe


def test_base_recipe_passes(workdir, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    for status, output in launch_both_modes(_recipe(workdir, None), [], capsys):
        assert status == 0, output


@pytest.mark.parametrize("case_id, edit, overrides, needle", CASES, ids=[case[0] for case in CASES])
def test_malformed_recipe_fails_in_launcher(workdir, case_id, edit, overrides, needle, monkeypatch, capsys):
    monkeypatch.chdir(workdir)
    (dry_status, dry_output), (status, output) = launch_both_modes(_recipe(workdir, edit), overrides, capsys)
    for exit_status, text in ((dry_status, dry_output), (status, output)):
        assert exit_status == 2, text
        assert "Traceback" not in text and "warning:" not in text, text
        errors = "\n".join(line for line in text.splitlines() if line.startswith("config error:"))
        assert re.search(needle, errors), text
    assert dry_output == output, "a dry run must fail with the real run's message"


@pytest.mark.parametrize("case_id, key, overrides, needle", ABSENT, ids=[case[0] for case in ABSENT])
def test_absent_input_is_refused_but_planned_in_a_dry_run(workdir, case_id, key, overrides, needle, monkeypatch,
                                                           capsys):
    """A real run refuses a missing data folder or tokenizer; a dry run (a cluster's plan on a laptop)
    plans without it, and says which input was absent and that its checks were skipped."""
    monkeypatch.chdir(workdir)
    (dry_status, dry_output), (status, output) = launch_both_modes(_recipe(workdir, None), overrides, capsys)
    assert status == 2 and re.search(needle, output) and "Traceback" not in output, output
    assert dry_status == 0 and "# plan" in dry_output, dry_output
    note = next(line for line in dry_output.splitlines() if "dry run: absent here, so planned" in line)
    assert key in note and "Skipped until they exist" in note, note


@pytest.mark.parametrize("case_id", ["duplicate-key", "empty-file", "small-vocab", "missing-init-from-hf"])
def test_train_sh_starts_no_worker_for_a_malformed_recipe(workdir, case_id):
    """As a user runs it: the launcher refuses the recipe and torchrun never starts (a dry run fails
    with the same message: ``test_malformed_recipe_fails_in_launcher``)."""
    _, edit, overrides, needle = next(case for case in CASES if case[0] == case_id)
    recipe = _recipe(workdir, edit)
    start = time.monotonic()
    result = train_sh(str(recipe), *overrides)
    assert result.returncode == 2, result.stderr
    assert re.search(needle, result.stderr), result.stderr
    assert "process(es)" not in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert time.monotonic() - start < 60


def test_every_alias_points_at_a_real_key():
    """A mistyped target in the alias table would silently fall back to difflib."""
    import dataclasses
    import typing

    from models.llm.config import LLMConfig
    from veomni.config.hints import ALIASES
    from veomni.config.schema import RunConfig

    sections = typing.get_type_hints(RunConfig)
    llm_fields = {f.name for f in dataclasses.fields(LLMConfig)}
    for alias, target in ALIASES.items():
        section, _, field = target.partition(".")
        fields = llm_fields if section == "model" else set(typing.get_type_hints(sections[section]))
        assert field in fields, f"{alias} -> {target}"
