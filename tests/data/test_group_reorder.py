"""Grouped reordering on real gloo groups: every drawn sample trained once, ranks balanced by cost,
exact resume of the windows, and the step's loss unchanged by which rank trains a sample."""

import random
from collections import Counter
from pathlib import Path

import pytest
import torch.distributed as dist

from harness.gloo_ranks import run_distributed
from tests.data.test_data_loader import config, write_shards
from tests.parity_utils import assert_records_close, run_steps
from veomni.data.balance import imbalance
from veomni.data.build_loader import build_dataloader
from veomni.data.group_reorder import GroupReorder, balance_group_size, balance_groups
from veomni.data.text.packed import load_tokenizer

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "stdlib-bpe-8k"
WORDS = ["def", "class", "return", "import", "self", "value", "data", "yield", "lambda", "tensor"]
GRAD_ACCUM, BUDGET, MAX_LEN = 2, 256, 128


def long_tailed_corpus(folder: Path) -> Path:
    """Documents whose lengths are long-tailed (most short, a few filling max_seq_len)."""
    rng = random.Random(0)
    docs = [f"d{i}: " + " ".join(rng.choice(WORDS) for _ in range(min(int(rng.lognormvariate(2.5, 1.2)) + 1, 200)))
            for i in range(1000)]
    return write_shards(folder, docs, per_shard=100)


def cost(drawn) -> float:
    """Dense work per token plus attention over the sample's causal pairs (a cost model of its own)."""
    n = len(drawn.item)
    return n + n * (n + 1) / 2 / 256  # the longest sample (128 tokens) costs 160, under the target of 256


def _reorder(rank, world, folder, group_size, steps, resume_at=None):
    tokenizer = load_tokenizer(str(TOKENIZER))
    cfg = config(folder, max_seq_len=MAX_LEN, tokens_per_micro_batch=BUDGET, shuffle_window=16)
    groups = balance_groups([list(range(world))], group_size)
    group = dist.new_subgroups_by_enumeration(groups, backend="gloo")[0] if group_size > 1 else None

    def build():
        loader = build_dataloader(cfg, "train", tokenizer, rank, world, 0)
        loader.dataset.unpacked = True
        return loader, GroupReorder(loader.dataset, iter(loader), GRAD_ACCUM, cost, BUDGET, 3, group)

    loader, reorder = build()
    drawn, trained, costs = [], [], []
    for step in range(steps):
        if step == resume_at:  # a new process: loader state and window restored from the saved state
            state, pending = loader.state_dict(), reorder.state_dict()
            loader, reorder = build()
            loader.load_state_dict(state)
            reorder._iter = iter(loader)
            reorder.load_state_dict(pending)
        bins = reorder.assign_step()
        trained.append([[(d.ref.file, d.ref.offset, d.ref.item_offset) for d in b] for b in bins])
        costs.append(sum(cost(d) for b in bins for d in b))
    drawn = [(p.drawn.ref.file, p.drawn.ref.offset, p.drawn.ref.item_offset) for p in reorder.window]
    return trained, drawn, costs, reorder.last


@pytest.mark.parametrize("world", [2, 4])
def test_every_sample_is_trained_once_and_ranks_are_balanced(tmp_path, world):
    folder = long_tailed_corpus(tmp_path / "d")
    steps = 8
    grouped = run_distributed(_reorder, world, folder, world, steps)
    alone = run_distributed(_reorder, world, folder, 1, steps)
    for results in (grouped, alone):
        # what the ranks' loaders drew is trained once or still waits in a window, never both
        seen = Counter(ref for trained, pending, _, _ in results for step in trained for b in step for ref in b)
        seen.update(ref for _, pending, _, _ in results for ref in pending)
        assert max(seen.values()) == 1, "a sample was trained twice"
        assert all(b for trained, _, _, _ in results for step in trained for b in step), "an empty micro-batch"
    packed = [run_distributed(_token_packed, 1, folder, rank, world, steps)[0] for rank in range(world)]
    step_imbalance = {name: max(imbalance([r[s] for r in costs]) for s in range(2, steps)) for name, costs in
                      (("grouped", [r[2] for r in grouped]), ("alone", [r[2] for r in alone]), ("tokens", packed))}
    assert step_imbalance["grouped"] <= 1.05 and step_imbalance["alone"] <= 1.1, step_imbalance
    assert step_imbalance["tokens"] > 1.05 > step_imbalance["grouped"], step_imbalance  # main: packed by tokens
    assert grouped[0][3]["balance_moved"] > 0


def _token_packed(rank, world, folder, dp_rank, dp_size, steps):
    """Per-step cost of one rank's micro-batches packed by the token budget alone (no balancing)."""
    tokenizer = load_tokenizer(str(TOKENIZER))
    cfg = config(folder, max_seq_len=MAX_LEN, tokens_per_micro_batch=BUDGET, shuffle_window=16)
    it = iter(build_dataloader(cfg, "train", tokenizer, dp_rank, dp_size, 0))
    lengths = [[n for _ in range(GRAD_ACCUM) for n in next(it)["cu_seqlens"].diff().tolist()] for _ in range(steps)]
    return [sum(n + n * (n + 1) / 2 / 256 for n in step) for step in lengths]


def test_resumed_windows_continue_exactly(tmp_path):
    folder = long_tailed_corpus(tmp_path / "d")
    straight = run_distributed(_reorder, 2, folder, 2, 6)
    resumed = run_distributed(_reorder, 2, folder, 2, 6, 3)
    assert [r[0] for r in resumed] == [r[0] for r in straight]


def _trained_samples(rank, world, folder):
    """Each rank's micro-batches (token lists) of 2 balanced steps, then FSDP steps on them."""
    tokenizer = load_tokenizer(str(TOKENIZER))
    cfg = config(folder, max_seq_len=MAX_LEN, tokens_per_micro_batch=BUDGET, shuffle_window=16)
    loader = build_dataloader(cfg, "train", tokenizer, rank, world, 0)
    loader.dataset.unpacked = True
    group = dist.new_subgroups_by_enumeration([list(range(world))], backend="gloo")[0]
    reorder = GroupReorder(loader.dataset, iter(loader), GRAD_ACCUM, cost, BUDGET, 3, group)
    steps = [[[list(d.item) for d in b] for b in reorder.assign_step()] for _ in range(2)]
    return steps, run_steps(steps, options={"vocab_size": 8192})


def _one_process(rank, world, steps):
    return run_steps(steps, options={"vocab_size": 8192})


def test_loss_and_gradients_equal_one_process_on_the_same_samples(tmp_path):
    folder = long_tailed_corpus(tmp_path / "d")
    ranks = run_distributed(_trained_samples, 2, folder)
    # one process, gradient accumulation over every rank's micro-batches of the step
    steps = [[b for steps, _ in ranks for b in steps[s]] for s in range(2)]
    reference = run_distributed(_one_process, 1, steps)[0]
    for _, record in ranks:
        assert_records_close(reference, record)


def test_group_size_defaults_to_the_node_and_must_divide_dp(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert balance_group_size(0, dp_size=16, ranks_per_dp_rank=2) == 4  # 8 ranks a node, 2 share each dp rank
    assert balance_group_size(0, dp_size=2, ranks_per_dp_rank=1) == 2
    assert balance_group_size(2, dp_size=8, ranks_per_dp_rank=1) == 2
    with pytest.raises(ValueError, match="divide"):
        balance_group_size(3, dp_size=8, ranks_per_dp_rank=1)
    assert balance_groups([[0, 2, 4, 6], [1, 3, 5, 7]], 2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
