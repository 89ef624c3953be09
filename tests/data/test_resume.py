"""The resume protocol every dataset kind shares (veomni/data/resume.py), on a minimal kind: exact
resume at the same layout, refusal of another layout's state, and the merge at a changed
data-parallel size (2 -> 3 and 3 -> 1 consumers) that skips nothing."""

from __future__ import annotations

import pytest

from veomni.data.resume import MERGED_KEY, ResumableDataset, ResumableLoader, every_consumer

ITEMS = 20


class Numbers(ResumableDataset):
    """Items 0..ITEMS-1 per epoch; consumer c of C takes positions i % C == c, one per batch."""

    state_format = "test.numbers.v1"

    def __iter__(self):
        epoch, first = self.begin()
        consumer, consumers = self.consumer()
        while True:
            for index in range(first, ITEMS):
                if index % consumers == consumer:
                    self._pos = (epoch, index + 1)
                    yield epoch * ITEMS + index
            epoch, first = epoch + 1, 0


def _take(dataset: ResumableDataset, n: int) -> list[int]:
    it = iter(dataset)
    return [next(it) for _ in range(n)]


def test_same_layout_resume_is_exact():
    old = Numbers(1, 2)
    _take(old, 13)  # into the second epoch
    expected = _take(Numbers(1, 2), 16)[13:]
    resumed = Numbers(1, 2)
    resumed.load_state_dict(old.state_dict())
    assert _take(resumed, 3) == expected
    assert old.state_dict() == {"format": "test.numbers.v1", "consumer": 1, "num_consumers": 2,
                                "epoch": 1, "index": 6}


def test_another_layouts_state_is_refused():
    state = Numbers(0, 2).state_dict()
    with pytest.raises(ValueError, match="merge the old ranks' states with merge_states"):
        Numbers(0, 3).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with 2 consumers .* this loader has 3"):
        ResumableLoader(Numbers(0, 3), batch_size=None).load_state_dict({"dataset_state": state})
    with pytest.raises(ValueError, match="not a test.numbers.v1 loader state"):
        Numbers(0, 2).load_state_dict({**state, "format": "other"})


@pytest.mark.parametrize("old_size, new_size", [(2, 3), (3, 1)])
def test_merge_at_a_new_dp_size_skips_nothing(old_size, new_size):
    seen, states = set(), []
    for rank in range(old_size):
        dataset = Numbers(rank, old_size)
        seen |= set(_take(dataset, 2 + rank))  # ranks at different positions
        states.append({"nested": [dataset.state_dict()]})  # as torchdata nests it
    merged = Numbers.merge_states(states)
    earliest = min(s["nested"][0]["index"] for s in states)
    assert merged == {MERGED_KEY: {"epoch": 0, "index": earliest}}
    after = []
    for rank in range(new_size):
        loader = ResumableLoader(Numbers(rank, new_size), batch_size=None)
        loader.load_state_dict(merged)
        after += [int(x) for x, _ in zip(loader, range(ITEMS))]
    assert set(range(ITEMS)) - seen <= set(after)  # every item not yet seen comes (some twice)


def test_merge_needs_states_of_this_kind():
    with pytest.raises(ValueError, match="no test.numbers.v1 dataset state"):
        Numbers.merge_states([{"format": "other"}])


def test_every_consumer_counts_peers_once_and_refuses_a_missing_one():
    states = [Numbers(rank, 2).state_dict() for rank in (0, 1, 1)]  # rank 1 saved by two sp peers
    assert [s["consumer"] for s in every_consumer(states)] == [0, 1]
    with pytest.raises(ValueError, match="pass the states of every rank"):
        every_consumer(states[:1])
