"""Chat rows under sequence and context parallelism: slicing a packed chat row the way the trainer
does (``shard_batch`` with the run's ``RowSplit``) leaves every assistant target on exactly one
rank with its label, and a real 2-rank gloo run with ``sp=2`` gives the loss and the loss-token
count of one process on the same row."""

from __future__ import annotations

import pytest

from harness.gloo_ranks import run_distributed
from tests.chat_utils import CONVERSATIONS, VOCAB, chat_loader, openai_line, write_chat_tokenizer, write_jsonl
from tests.parity_utils import assert_scalar_parity, tiny_model
from veomni.config.schema import ParallelConfig
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.row_split import RowSplit, shard_batch
from veomni.tasks import LM_CONTRACT
from veomni.tasks.base import IGNORE_INDEX
from veomni.tasks.lm import LanguageModelingTask
from veomni.train.step import forward_backward


@pytest.fixture(scope="module")
def row(tmp_path_factory) -> dict:
    """One packed row of every test conversation (an odd length, so the split pads)."""
    root = tmp_path_factory.mktemp("chat_sp")
    tokenizer = write_chat_tokenizer(root / "tokenizer")
    path = write_jsonl(root / "c.jsonl", [openai_line(m) for m in CONVERSATIONS])
    (batch,) = list(chat_loader(path, tokenizer, tokens_per_micro_batch=1024))
    assert batch["num_samples"] == len(CONVERSATIONS)
    return batch


def _targets(batch: dict, split: RowSplit) -> set[tuple[int, int]]:
    """(global position, label) of every loss target of this rank's slice."""
    local = shard_batch(batch, split, LM_CONTRACT)
    positions = split.positions(batch["cu_seqlens"].tolist(), batch["input_ids"].numel())
    return {(int(p), int(label)) for p, label in zip(positions, local["labels"]) if label != IGNORE_INDEX}


@pytest.mark.parametrize("sp, cp", [(2, 1), (4, 1), (1, 2), (2, 2)], ids=["sp2", "sp4", "cp2", "sp2xcp2"])
def test_every_target_lands_on_exactly_one_rank(row, sp, cp):
    whole = _targets(row, RowSplit())
    assert row["input_ids"].numel() % (2 * sp * cp) and len(whole) > 0
    parts = [_targets(row, RowSplit(sp_rank=s, sp=sp, cp_rank=c, cp=cp)) for c in range(cp) for s in range(sp)]
    assert set().union(*parts) == whole
    assert sum(len(p) for p in parts) == len(whole)  # none twice


def _sp_loss(rank: int, world: int, batch: dict) -> tuple[float, int, set[tuple[int, int]]]:
    parallel = ParallelConfig(sp=world)
    dims = ParallelDims.resolve(parallel, world)
    meshes = build_mesh(dims, "cpu")
    model = parallelize(tiny_model(vocab_size=VOCAB), parallel, meshes, "cpu")
    task = LanguageModelingTask()
    local = shard_batch(batch, meshes.row_split, task.contract)  # as the trainer slices a row
    metrics = forward_backward(model, task, [local], meshes.loss.get_group(), dims.loss_size, dims.row_ranks)
    return metrics["loss"], metrics["loss_units"], _targets(batch, meshes.row_split)


def test_sp2_run_matches_one_process_on_a_chat_row(row):
    (reference,) = run_distributed(_sp_loss, 1, row)
    ranks = run_distributed(_sp_loss, 2, row)
    assert reference[1] == int((row["labels"] != IGNORE_INDEX).sum())
    assert reference[2] == ranks[0][2] | ranks[1][2] and not ranks[0][2] & ranks[1][2]
    for loss, units, _ in ranks:
        assert units == reference[1]
        assert_scalar_parity(loss, reference[0], "sp=2 loss of a chat row")
