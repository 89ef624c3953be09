"""The restore decision's re-deal of balancing windows at a changed data-parallel size
(veomni/data/resume.py): every drawn, untrained sample goes to exactly one new rank."""

from __future__ import annotations

from veomni.data.resume import pending_share


def test_balancing_windows_are_dealt_to_the_new_ranks_once_each():
    old = [{"dp_rank": 1, "pending": [["b", 1]]}, {"dp_rank": 0, "pending": [["a", 1], ["a", 2]]},
           {"dp_rank": 1, "pending": [["b", 1]]}]  # dp rank 1 saved by two sequence-parallel peers
    shares = [pending_share(old, rank, 2) for rank in range(2)]
    assert shares == [[["a", 1], ["b", 1]], [["a", 2]]]
    assert pending_share(old, 0, 1) == [["a", 1], ["a", 2], ["b", 1]]
