"""Packing: the micro-batch contract, chunking and the greedy token budget."""

import random

import pytest
import torch

from veomni.data.packing import chunk_document, greedy_pack, pack_samples
from veomni.tasks import IGNORE_INDEX


def test_pack_samples_builds_the_contract():
    batch = pack_samples([[11, 12, 13], [21, 22], [31]])
    assert batch["input_ids"].tolist() == [11, 12, 13, 21, 22, 31]
    assert batch["labels"].tolist() == [12, 13, IGNORE_INDEX, 22, IGNORE_INDEX, IGNORE_INDEX]
    assert batch["position_ids"].tolist() == [0, 1, 2, 0, 1, 0]
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 6]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["input_ids"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.long
    assert batch["max_seqlen"] == 3 and batch["num_samples"] == 3


@pytest.mark.parametrize("samples", [[], [[1, 2], []]])
def test_pack_samples_rejects_empty(samples):
    with pytest.raises(ValueError):
        pack_samples(samples)


def test_chunk_document_cuts_consecutive_chunks():
    ids = list(range(10))
    assert list(chunk_document(ids, 4)) == [(0, [0, 1, 2, 3]), (4, [4, 5, 6, 7]), (8, [8, 9])]
    assert list(chunk_document(ids, 4, start=4)) == [(4, [4, 5, 6, 7]), (8, [8, 9])]
    assert list(chunk_document(ids, 10)) == [(0, ids)]


def test_greedy_pack_respects_budget_and_order():
    rng = random.Random(0)
    samples = [[rng.randrange(100)] * rng.randint(1, 50) for _ in range(300)]
    budget = 120
    tagged = [(s, i) for i, s in enumerate(samples)]
    batches = list(greedy_pack(tagged, budget))
    flat = [s for batch, _ in batches for s in batch]
    assert flat == samples  # order kept, nothing dropped, split or padded
    for n, (batch, next_tag) in enumerate(batches):
        used = sum(len(s) for s in batch)
        assert used <= budget
        if next_tag is None:
            assert n == len(batches) - 1
        else:  # greedy: the sample that starts the next batch really did not fit
            assert samples[next_tag] is batches[n + 1][0][0]
            assert used + len(samples[next_tag]) > budget


def test_greedy_pack_rejects_sample_over_budget():
    with pytest.raises(ValueError):
        list(greedy_pack([([1] * 5, 0)], budget=4))
