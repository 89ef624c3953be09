"""The planted-bug list (``tests/mutations.toml``, run by ``scripts/mutate.py``) follows the code:
every entry names a file that exists, an original text found there exactly once, a replacement that
differs, and tests whose files define them; so a refactor that moves a planted line fails here, in
the fast tier, rather than when someone next runs the mutations (docs/testing.md, "Planted bugs")."""

from __future__ import annotations

from pathlib import Path

import pytest

from veomni.data.builders import load_script

REPO = Path(__file__).resolve().parents[2]


def test_every_planted_bug_fits_the_code_and_names_existing_tests():
    mutate = load_script(REPO / "scripts" / "mutate.py")
    mutations = mutate.load()
    assert len(mutations) >= 20, "the list is the project's record of planted bugs: keep it whole"
    assert mutate.problems(mutations) == []


def test_a_moved_original_or_a_missing_test_is_named(tmp_path):
    """The check itself: an original text that no longer occurs and a test function that does not
    exist are both reported by the entry's id."""
    mutate = load_script(REPO / "scripts" / "mutate.py")
    (tmp_path / "code.py").write_text("x = 1\nx = 1\n")
    (tmp_path / "test_code.py").write_text("def test_x():\n    pass\n")
    stale = mutate.Mutation("stale", "code.py", "x = 1", "x = 2", ("test_code.py::test_y",), "why")
    assert mutate.problems([stale], tmp_path) == [
        "stale: the original text occurs 2 times in code.py (must be once): update the entry to the code",
        "stale: test_code.py::test_y names no test function of test_code.py"]
    (tmp_path / "list.toml").write_text('[[mutation]]\nid = "a"\nfile = "code.py"\n')
    with pytest.raises(ValueError, match=r"entry 0 \(a\) lacks \['original', 'replacement', 'tests', 'why'\]"):
        mutate.load(tmp_path / "list.toml")
