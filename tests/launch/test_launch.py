"""The user-facing commands, run as a user runs them: ``bash scripts/train.sh ...``."""

import json
import os
import re
import shlex
import socket
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "recipes" / "quickstart" / "tiny_llm.yaml"
SMALL = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_layers", "2",
         "--model.num_heads", "4", "--model.num_kv_heads", "2", "--model.head_dim", "16",
         "--data.tokens_per_micro_batch", "512", "--data.max_seq_len", "256",
         "--train.eval_batches", "1", "--train.sample_tokens", "6"]


def train_sh(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    # a test's own layout: a Slurm / Kubeflow allocation the tests run inside must not set it
    outside = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_"))}
    full_env = {**outside, "NPROC_PER_NODE": "2", **(env or {})}
    return subprocess.run(["bash", str(REPO / "scripts" / "train.sh"), *args], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def dry_run(capfd, recipe: str, *args: str) -> subprocess.CompletedProcess:
    """``train.sh RECIPE --dry-run ARGS`` without its interpreter start: a dry run of ``train.sh`` is
    its launcher's ``main`` at the world it would start (2 CPU processes) and nothing after it, so a
    plan runs that ``main`` in this process (``train.sh``'s own dry-run path:
    ``test_qwen3_8b_dry_run_parameter_count``). Output captured at the descriptors, as ``train_sh``'s."""
    from veomni.launch import main

    status = main([recipe, "--launcher-world-size", "2", "--dry-run", *args])
    captured = capfd.readouterr()
    return subprocess.CompletedProcess([recipe, "--dry-run", *args], status, captured.out, captured.err)


@pytest.mark.parametrize("args, needle", [
    (["--train.max_step", "3"], r"--train\.max_step: unknown key 'train\.max_step'; did you mean 'train\.max_steps'"),
    (["--train.lr", "fast"], r"--train\.lr: train\.lr: expected a number, got 'fast'"),
    (["--parallel.dp_replicate", "3"], r"dp_replicate=3 does not divide the world size 2"),
    (["--data.train_path", "/nonexistent/shards", "--data.prepare", "null"],
     r"data\.train_path: path does not exist: /nonexistent/shards"),
    (["--model.num_kv_heads", "3"], r"num_heads \(8\) must be a multiple of num_kv_heads \(3\)"),
    (["--train.sample_interval", "10"], r"train\.sample_interval=10: model family 'llm' writes no validation samples"),
], ids=["unknown-key", "wrong-type", "indivisible", "missing-data", "bad-model", "no-sample-writer"])
def test_bad_config_fails_fast_without_workers(args, needle):
    start = time.monotonic()
    result = train_sh(str(QUICKSTART), *args)
    assert result.returncode == 2, result.stderr
    assert re.search(needle, result.stderr), result.stderr
    assert "process(es)" not in result.stderr, "workers were launched"
    assert time.monotonic() - start < 60


def test_unknown_key_in_file_names_line(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(QUICKSTART.read_text().replace("  grad_accum: 1", "  grad_acum: 1"))
    result = train_sh(str(recipe))
    line = QUICKSTART.read_text().splitlines().index("  grad_accum: 1") + 1
    assert result.returncode == 2 and f"r.yaml:{line}" in result.stderr and "grad_accum" in result.stderr


def test_qwen3_8b_dry_run_parameter_count():
    result = train_sh(str(REPO / "recipes" / "qwen3" / "qwen3_8b.yaml"), "--dry-run", "--world-size", "64", "--gpus")
    assert result.returncode == 0, result.stderr
    count = int(re.search(r"parameters\s+([\d,]+)", result.stdout).group(1).replace(",", ""))
    assert abs(count - 8.19e9) / 8.19e9 < 0.01  # Qwen3-8B: 8.19B parameters
    assert "dp_shard=64" in result.stdout and "GFLOP per token" in result.stdout
    assert re.search(r"total\s+[\d.]+", result.stdout)


def test_quickstart_recipe_trains_end_to_end(tmp_path):
    out = tmp_path / "run"
    result = train_sh(str(QUICKSTART), "--train.max_steps", "3", "--train.output_dir", str(out),
                      "--checkpoint.interval", "2", "--train.eval_interval", "0", "--train.sample_tokens", "6")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for field in ("step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "tokens_per_s_per_device",
                  "mfu", "peak_mem_gb"):
        assert field in steps[-1], field
    assert any("eval_loss" in r for r in records)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002", "step_00000003"]
    assert (out / "config.yaml").is_file()
    assert "sample" in result.stderr and "def read_config(path):" in result.stderr


def test_run_ends_with_a_summary_against_the_baseline(tmp_path):
    """A run that learns (a tiny model on a corpus it can predict from context) ends with the
    summary, after the last step's line, and writes its numbers to summary.json."""
    corpus = tmp_path / "cycle"
    corpus.mkdir()
    words = "one two three four five six seven eight".split()
    (corpus / "docs.jsonl").write_text("".join(
        json.dumps({"txt": " ".join(words[(i + j) % 8] for j in range(100))}) + "\n" for i in range(40)))
    out = tmp_path / "run"
    overrides = [*SMALL, "--data.train_path", str(corpus), "--data.eval_path", str(corpus),
                 "--data.format", "jsonl", "--data.prepare", "null", "--train.lr", "1e-2",
                 "--train.warmup_steps", "2", "--train.output_dir", str(out)]
    result = train_sh(str(QUICKSTART), *overrides, "--train.max_steps", "30")
    assert result.returncode == 0, result.stderr[-3000:]
    log = result.stderr
    summary = log[log.index("run summary: 30 steps", log.rindex("step 30  loss=")):]
    record = json.loads((out / "summary.json").read_text())
    assert record["eval_loss"] < record["baseline"]["loss"], record
    eval_loss, baseline = record["eval_loss"], record["baseline"]["loss"]
    assert f"{eval_loss:.3f} nats vs {baseline:.3f} for token frequencies alone" in summary
    assert f"{baseline - eval_loss:.3f} nats below the baseline" in summary
    assert re.search(r"train loss    [\d.]+ at step 1 -> [\d.]+ at step 30", summary)
    assert re.search(r"throughput    [\d,.]+ tokens/s \(median of steps 4-30\), MFU", summary)
    assert str(out / "checkpoints" / "step_00000030") in summary and "def read_config(path):" in summary
    command = summary.split("train on to step 120, resuming from the checkpoint of step 30:\n")[1]
    assert shlex.split(command.splitlines()[0]) == ["bash", "scripts/train.sh", str(QUICKSTART), *overrides,
                                                    "--train.max_steps", "120"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_long_context_recipe_trains_with_sequence_parallelism(tmp_path):
    """The 32k recipe's path (sp=2 through train.sh, long-document corpus, eval, checkpoint,
    decoding with full-sequence attention) at a CI-sized sequence length."""
    out = tmp_path / "run"
    result = train_sh(str(REPO / "recipes" / "long-context" / "tiny_32k.yaml"), "--data.max_seq_len", "2048",
                      "--data.tokens_per_micro_batch", "2048", "--train.max_steps", "2",
                      "--train.output_dir", str(out), "--train.sample_tokens", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sp=2 (Ulysses)" in result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2] and any("eval_loss" in r for r in records)
    assert (out / "checkpoints" / "step_00000002" / "complete.json").is_file()


def test_sp_that_does_not_divide_the_heads_fails_at_config_time():
    result = train_sh(str(REPO / "recipes" / "long-context" / "tiny_32k.yaml"), "--parallel.sp", "4",
                      "--model.num_heads", "6", "--model.num_kv_heads", "3", env={"NPROC_PER_NODE": "4"})
    assert result.returncode == 2 and "process(es)" not in result.stderr
    assert "parallel.sp=4 does not divide the 6 attention heads" in result.stderr


def _launch(capfd, *overrides: str) -> tuple[int, str]:
    """The pre-flight in-process, as train.sh runs it; returns its exit status and all output
    (the builder's included: it is a subprocess writing to the same file descriptors)."""
    from veomni.launch import main

    status = main([str(QUICKSTART), *overrides])
    captured = capfd.readouterr()
    return status, captured.out + captured.err


def test_launcher_rebuilds_a_cache_of_an_older_format_version(tmp_path, capfd):
    train, eval_ = tmp_path / "stdlib" / "train", tmp_path / "stdlib" / "eval"
    for split in (train, eval_):  # what an older builder left: shards plus a manifest of version 0
        split.mkdir(parents=True)
        (split / "shard-000000.tar").write_bytes(b"")
        (split / "manifest.json").write_text(json.dumps({"documents": 1, "format_version": 0}))
    paths = ["--data.train_path", str(train), "--data.eval_path", str(eval_)]

    status, output = _launch(capfd, *paths)
    assert status == 0, output
    assert "[launch] preparing data" in output and "cached" not in output
    manifests = [json.loads((split / "manifest.json").read_text()) for split in (train, eval_)]
    assert all(m["format_version"] > 0 and m["documents"] > 1 for m in manifests)
    assert all((split / "shard-000000.tar").stat().st_size > 0 for split in (train, eval_))

    status, output = _launch(capfd, *paths)  # now current: only checked, not rebuilt
    assert status == 0 and "cached" in output, output


def test_launcher_leaves_user_shards_without_a_manifest_alone(tmp_path, capfd):
    import webdataset

    shards = tmp_path / "mine"
    shards.mkdir()
    with webdataset.TarWriter(str(shards / "shard-000000.tar")) as writer:
        writer.write({"__key__": "d0", "txt": "def f():\n    return 1\n"})
    status, output = _launch(capfd, "--data.train_path", str(shards), "--data.eval_path", str(shards))
    assert status == 0, output
    assert "preparing data" not in output
    assert sorted(p.name for p in shards.iterdir()) == ["shard-000000.tar"]
