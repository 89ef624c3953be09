"""``train.eval_batches: 0`` scores the whole held-out set, the same samples at any process count:
the eval loss, its token and sample counts and the baseline of one process equal those of two
data-parallel ranks (whose shares end at different times: the one that ends first runs uncounted
repeats), of three, and of a sequence-parallel pair. A limited eval reports how many samples it
scored."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.gloo_ranks import run_distributed
from tests.parity_utils import assert_scalar_parity
from tests.trainer_utils import tiny_run_config
from veomni.config.schema import ParallelConfig
from veomni.data.build_loader import build_dataloader, load_run_tokenizer
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full


def _eval(rank, world, tmp, parallel, eval_batches):
    cfg = tiny_run_config(Path(tmp), eval_batches=eval_batches)
    cfg.train.output_dir = str(Path(tmp) / f"out{world}")
    cfg.parallel = parallel
    trainer = Trainer(cfg)
    result = trainer.evaluate()
    return result, trainer.baseline.loss


def _held_out_samples(tmp: Path) -> int:
    cfg = tiny_run_config(tmp)
    loader = build_dataloader(cfg.data, "eval", load_run_tokenizer(cfg.data, "packed_text"), 0, 1, cfg.train.seed)
    return sum(int(batch["cu_seqlens"].numel()) - 1 for batch in loader)


def _shares(tmp: Path, dp_size: int) -> list[int]:
    cfg = tiny_run_config(tmp)
    tokenizer = load_run_tokenizer(cfg.data, "packed_text")
    return [len(list(build_dataloader(cfg.data, "eval", tokenizer, rank, dp_size, cfg.train.seed)))
            for rank in range(dp_size)]


def test_the_whole_held_out_set_scores_the_same_at_any_process_count(tmp_path):
    tmp = str(tmp_path)
    (one, one_baseline), = run_distributed(_eval, 1, tmp, ParallelConfig(), 0)
    assert one["eval_samples"] == _held_out_samples(tmp_path)
    assert len(set(_shares(tmp_path, 3))) > 1  # at 3 ranks the shares differ: the repeats are exercised
    for world, parallel in ((2, ParallelConfig()), (3, ParallelConfig()), (2, ParallelConfig(sp=2))):
        for got, baseline in run_distributed(_eval, world, tmp, parallel, 0):
            assert got["eval_samples"] == one["eval_samples"], (world, parallel)
            assert got["eval_loss_tokens"] == one["eval_loss_tokens"], (world, parallel)
            assert_scalar_parity(got["eval_loss"], one["eval_loss"], f"eval_loss at {world} ranks")
            assert_scalar_parity(baseline, one_baseline, f"baseline at {world} ranks")


def test_a_limited_eval_counts_the_samples_it_scored(tmp_path):
    (result, _), = run_distributed(_eval, 1, str(tmp_path), ParallelConfig(), 1)
    cfg = tiny_run_config(tmp_path)
    first = next(iter(build_dataloader(cfg.data, "eval", load_run_tokenizer(cfg.data, "packed_text"), 0, 1,
                                       cfg.train.seed)))
    assert result["eval_samples"] == int(first["cu_seqlens"].numel()) - 1
