"""Malformed variants of the newer recipes (video DiT, GNNPipe, VLM, context parallel, data mixture)
fail in the launcher, dry run and real run alike, within seconds, exit 2, naming the key, without a
traceback and before any worker starts; a fresh clone's dry run plans without the data; and an
error only a worker can meet (bad records) stops the run once, with its message, instead of being
retried ``train.max_restarts`` times.

The launcher runs in process (its ``main``); one ``train.sh`` run covers the worker's stop, in the
full tier (a whole run with a restart of its workers: 40-220 s on a loaded 2-core machine).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.config.test_bad_recipes import BASE
from tests.launch.test_launch import train_sh
from tests.trainer_utils import TOKENIZER, write_corpus
from veomni import launch

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DIT, GNN, VLM = "goku/tiny_t2v.yaml", "gnnpipe/tiny.yaml", "seed1.5-vl/tiny.yaml"
CP, MIXTURE = "long-context/tiny_32k_cp.yaml", "quickstart/tiny_llm_mixture.yaml"
TEXT = (VLM, CP, MIXTURE)
"""The recipes whose dataset kinds cut samples at ``data.max_seq_len`` (text and chat)."""

EVERY = [
    # (id, CLI overrides, regex of the refusal): on every recipe
    ("nan-lr", ["--train.lr", ".nan"], r"train\.lr: expected a finite number, got nan"),
    ("inf-clip", ["--train.max_grad_norm", ".inf"], r"train\.max_grad_norm: expected a finite number, got inf"),
    ("zero-seq-len", ["--data.max_seq_len", "0"], r"data\.max_seq_len must be >= 1"),
    ("pp-and-cp", ["--parallel.pp", "2", "--parallel.cp", "2"],
     r"parallel\.cp=2 does not divide the ranks of one pipeline stage.*lower parallel\.pp"),
]
ON_TEXT = [
    ("micro-batch-below-seq-len", ["--data.tokens_per_micro_batch", "8"],
     r"data\.tokens_per_micro_batch \(8\) must be >= data\.max_seq_len"),
]
BY_RECIPE = [
    (MIXTURE, "inf-source-weight", ["--data.sources", "[{path: /nonexistent/a, weight: .inf}]"],
     r"data\.sources\[0\]\.weight: expected a finite number, got inf"),
    (MIXTURE, "nan-source-weight", ["--data.sources", "[{path: /nonexistent/a, weight: .nan}]"],
     r"data\.sources\[0\]\.weight: expected a finite number, got nan"),
    (MIXTURE, "blocks-for-pp", ["--parallel.pp", "2", "--model.num_layers", "1", "--train.grad_accum", "2"],
     r"has only 1 blocks.*raise model\.num_layers"),
    (GNN, "blocks-for-pp", ["--model.num_layers", "1"], r"has only 1 blocks.*raise model\.num_layers"),
    (DIT, "nan-model-float", ["--model.shift", ".nan"], r"model\.shift: expected a finite number"),
]
CASES = ([(recipe, *case) for recipe in (DIT, GNN, VLM, CP, MIXTURE) for case in EVERY]
         + [(recipe, *case) for recipe in TEXT for case in ON_TEXT] + BY_RECIPE)


def _launch(recipe: str, *args: str, capsys) -> tuple[int, str, float]:
    start = time.monotonic()
    status = launch.main([str(RECIPES / recipe), "--launcher-world-size", "2", *args])
    captured = capsys.readouterr()
    return status, captured.out + captured.err, time.monotonic() - start


@pytest.mark.parametrize("recipe, case_id, overrides, needle", CASES,
                         ids=[f"{Path(c[0]).stem}-{c[1]}" for c in CASES])
def test_malformed_variant_fails_in_the_launcher(recipe, case_id, overrides, needle, tmp_path, capsys):
    outputs = []
    for mode in (["--dry-run"], []):
        status, output, seconds = _launch(recipe, *mode, *overrides, "--train.output_dir", str(tmp_path), capsys=capsys)
        assert status == 2 and seconds < 20, output
        assert "Traceback" not in output and "preparing data" not in output, output  # nothing built, no worker
        assert re.search(needle, output), output
        outputs.append(output)
    assert outputs[0] == outputs[1], "a dry run must fail with the real run's message"


def test_a_fresh_clone_plans_the_mixture_without_its_data(tmp_path, capsys):
    """The sources' builders and their held-out split do not exist yet: the dry run says what it
    would build and what it skipped, and plans."""
    built = RECIPES.parent / "data"
    sources = (f"[{{name: a, path: {tmp_path}/a/train, prepare: {built}/build_stdlib_corpus.py}}, "
               f"{{name: b, path: {tmp_path}/b/train, prepare: {built}/build_stdlib_long_corpus.py}}]")
    status, output, _ = _launch(MIXTURE, "--dry-run", "--data.sources", sources, "--data.eval_path",
                                f"{tmp_path}/a/eval", capsys=capsys)
    assert status == 0 and "# plan" in output, output
    assert re.search(r"dry run: absent here.*data\.eval_path.*Skipped until they exist", output), output
    assert not (tmp_path / "a").exists(), "a dry run builds nothing"


def test_vocabulary_without_room_for_placeholders_is_refused_in_the_launcher(vqa_build, tmp_path, capsys):
    """The tokenizer's 8192 tokens fit 8192, but not with the <image> placeholder: a check of the
    tokenizer and the model config, so the launcher makes it, naming the key."""
    args = ["--data.train_path", str(vqa_build / "train"), "--data.eval_path", str(vqa_build / "eval"),
            "--data.prepare", "null", "--model.llm.vocab_size", "8192", "--train.output_dir", str(tmp_path)]
    status, output, _ = _launch(VLM, *args, capsys=capsys)
    assert status == 2 and "Traceback" not in output, output
    assert re.search(r"model\.llm\.vocab_size=8192 has no room for the placeholder tokens \['<image>'\]", output)


@pytest.mark.full  # a whole run through scripts/train.sh (tests/conftest.py)
def test_bad_records_stop_the_run_once_without_a_traceback(tmp_path):
    """Bad data is found by a worker only (the launcher reads one record per source): the run stops
    at once with the reader's message, not after ``train.max_restarts`` restarts with tracebacks."""
    write_corpus(tmp_path / "corpus" / "train", documents=6, seed=0)
    write_corpus(tmp_path / "corpus" / "eval", documents=2, seed=1)
    with (tmp_path / "corpus" / "train" / "docs.jsonl").open("a") as shard:
        shard.write("{not json\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(BASE.format(tokenizer=TOKENIZER).replace("corpus/", f"{tmp_path}/corpus/")
                      .replace("output_dir: out", f"output_dir: {tmp_path}/out"))
    result = train_sh(str(recipe), "--data.max_bad_fraction", "0.0", "--train.max_steps", "20",
                      "--train.max_restarts", "3")
    assert result.returncode == 1, result.stderr
    # torchrun restarts the group once; the new workers find the stop and leave before training:
    # the trainer started once (a wall-clock bound here failed on a loaded machine, not the code)
    assert result.stderr.count("training 20 steps from scratch") == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert re.search(r"\[train\.sh\] run stopped: \d+ of \d+ records were bad .*summed over the run's 2 data-parallel "
                     r"rank\(s\); worst file .*corpus/train", result.stderr)
