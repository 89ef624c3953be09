"""The trainer on data at scale: a run stopped mid-epoch and resumed gives the uninterrupted run's
losses with a three-source mixture and with balanced ranks; the realised mixture is in metrics."""

import json
from pathlib import Path

import pytest

from harness.gloo_ranks import run_distributed
from tests.trainer_utils import tiny_run_config, write_corpus
from veomni.config.schema import SourceConfig
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)


def _config(tmp: str, mixture: bool, balance: bool):
    cfg = tiny_run_config(Path(tmp))
    if mixture:
        sources = []
        for index, (name, weight) in enumerate((("code", 0.5), ("prose", 0.3), ("notes", 0.2))):
            folder = Path(tmp) / "mix" / name
            if not folder.exists():
                write_corpus(folder, documents=50 + 20 * index, seed=10 + index)
            sources.append(SourceConfig(path=str(folder), weight=weight, name=name))
        cfg.data.train_path, cfg.data.sources = "", sources
    cfg.data.balance = balance
    cfg.data.shuffle_window = 8
    return cfg


def _uninterrupted(rank, world, tmp, mixture, balance):
    return [m["loss"] for m in Trainer(_config(tmp, mixture, balance)).train()]


def _crash_after_3_then_resume(rank, world, tmp, mixture, balance):
    first = Trainer(_config(tmp, mixture, balance))
    before = [first.run_step()["loss"] for _ in range(3)]  # checkpoint.interval=3 saves here
    del first  # the process "dies": no finish(), no final save
    second = Trainer(_config(tmp, mixture, balance))
    return before, [m["loss"] for m in second.train()]


@pytest.mark.parametrize("mixture, balance", [(True, False), (False, True), (True, True)],
                         ids=["3-source-mixture", "balanced", "balanced-mixture"])
def test_resume_mid_epoch_gives_the_uninterrupted_losses(tmp_path, mixture, balance):
    full = run_distributed(_uninterrupted, 2, str(tmp_path / "a"), mixture, balance)[0]
    before, after = run_distributed(_crash_after_3_then_resume, 2, str(tmp_path / "b"), mixture, balance)[0]
    assert len(full) == 6 and before == full[:3] and after == full[3:]
    records = [json.loads(line) for line in (tmp_path / "a" / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and "eval_loss" not in r]
    if mixture:
        shares = [sum(r[f"mix_{name}"] for r in steps) / len(steps) for name in ("code", "prose", "notes")]
        assert shares == pytest.approx([0.5, 0.3, 0.2], abs=0.06), shares
    if balance:
        assert all(r["balance_imbalance_est"] < 1.5 for r in steps)


def _three_steps(rank, world, tmp):
    trainer = Trainer(_config(tmp, False, True))
    for _ in range(3):
        trainer.run_step()  # checkpoint.interval=3 saves the balancing windows with the loader states


def _finish(rank, world, tmp):
    trainer = Trainer(_config(tmp, False, True))
    return trainer.step, len(trainer._pending), [m["loss"] for m in trainer.train()]


def test_balanced_run_resumes_at_another_world_size(tmp_path):
    run_distributed(_three_steps, 2, str(tmp_path))
    step, pending, losses = run_distributed(_finish, 1, str(tmp_path))[0]
    assert step == 3 and pending > 0  # both old ranks' waiting samples came to the one new rank
    assert len(losses) == 3 and all(loss == loss for loss in losses)


def _vlm_config(tmp: str):
    """The tiny VLM on a 0.6/0.4 mixture of image-text and text-only chat shards, ranks balanced."""
    from harness.media_bytes import png_bytes
    from tests.omni_utils import TINY_OMNI, chat_record, write_shard

    cfg = _config(tmp, False, True)
    folders = {"vqa": Path(tmp) / "vqa", "chat": Path(tmp) / "chat"}
    if not folders["vqa"].exists():
        for shard in range(2):
            write_shard(folders["vqa"] / f"s{shard}.tar",
                        [chat_record(f"v{shard}_{i}", "What color is it?", ["red", "blue"][i % 2],
                                     png_bytes(40 * shard + i)) for i in range(40)])
            write_shard(folders["chat"] / f"s{shard}.tar",
                        [chat_record(f"c{shard}_{i}", "Say yes or no. " * (1 + i % 9), ["yes", "no"][i % 2])
                         for i in range(40)])
    cfg.model.arch, cfg.model.options = "omni", TINY_OMNI
    cfg.data.train_path, cfg.data.eval_path, cfg.data.text_key, cfg.data.format = "", None, "json", "auto"
    cfg.data.sources = [SourceConfig(path=str(folders["vqa"]), weight=0.6, name="vqa"),
                        SourceConfig(path=str(folders["chat"]), weight=0.4, name="chat")]
    cfg.data.max_seq_len, cfg.data.tokens_per_micro_batch = 192, 384
    return cfg


def _vlm_uninterrupted(rank, world, tmp):
    return [m["loss"] for m in Trainer(_vlm_config(tmp)).train()]


def _vlm_crash_and_resume(rank, world, tmp):
    first = Trainer(_vlm_config(tmp))
    before = [first.run_step()["loss"] for _ in range(3)]
    del first
    return before, [m["loss"] for m in Trainer(_vlm_config(tmp)).train()]


def test_vlm_mixture_of_image_and_text_sources_balanced_resumes_exactly(tmp_path):
    full = run_distributed(_vlm_uninterrupted, 2, str(tmp_path / "a"))[0]
    before, after = run_distributed(_vlm_crash_and_resume, 2, str(tmp_path / "b"))[0]
    assert len(full) == 6 and before == full[:3] and after == full[3:]
    records = [json.loads(line) for line in (tmp_path / "a" / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "balance_fill" in r]
    assert len(steps) == 6 and all(0 < r["mix_vqa"] < 1 for r in steps)


def test_mixture_quickstart_recipe_trains_through_train_sh(tmp_path):
    """The quick-start mixture recipe as a user runs it: both corpora built by their own builders,
    2 processes, balanced ranks; the realised mixture and the balancing estimates in metrics."""
    from tests.launch.test_launch import REPO, train_sh

    out = tmp_path / "run"
    result = train_sh(str(REPO / "recipes" / "quickstart" / "tiny_llm_mixture.yaml"), "--train.max_steps", "3",
                      "--train.output_dir", str(out), "--train.eval_interval", "0", "--train.eval_batches", "1",
                      "--log.interval", "1", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "step_time_s" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["mix_stdlib"] + r["mix_packages"] == pytest.approx(1.0) and r["balance_fill"] > 0 for r in steps)
