"""The recipe reference lists every schema key, the README starts with the two commands, and every
file the docs name exists."""

import dataclasses
import re
import subprocess
from pathlib import Path

from veomni.config.schema import RunConfig

REPO = Path(__file__).resolve().parents[2]


def test_configuration_doc_lists_every_key():
    doc = (REPO / "docs" / "configuration.md").read_text()
    missing = []
    for section in dataclasses.fields(RunConfig):
        if section.name == "model":
            continue
        if f"## `{section.name}`" not in doc:
            missing.append(section.name)
        for field in dataclasses.fields(section.default_factory()):
            if not re.search(rf"`{field.name}`", doc):
                missing.append(f"{section.name}.{field.name}")
    assert not missing, f"undocumented recipe keys: {missing}"


def test_readme_opens_with_the_two_commands():
    readme = (REPO / "README.md").read_text()
    first_block = readme.split("```")[1]
    assert "bash scripts/train.sh recipes/quickstart/tiny_llm.yaml" in first_block
    assert "bash scripts/test.sh" in first_block
    for link in re.findall(r"\]\((docs/[^)]+)\)", readme):
        assert (REPO / link).is_file(), link


def test_every_python_file_the_docs_and_docstrings_name_exists() -> None:
    """A file or folder named in backticks (a path, or a bare file name) in the docs, the README or
    a docstring exists: a path as written, a bare name somewhere in the tree. Moves leave no stale
    name."""
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    paths, names = set(tracked), {Path(f).name for f in tracked}
    stale = []
    for file in tracked:
        if not file.endswith((".md", ".py")) or file.startswith("data/cache"):
            continue
        for name in re.findall(r"`{1,2}([\w./-]+\.py)\b", (REPO / file).read_text(errors="replace")):
            name = name.removeprefix("./")
            known = (name in paths or any(p.endswith("/" + name) for p in paths)) if "/" in name else name in names
            if not known and not name.startswith(("torch/", "transformers/", "diffusers/")):
                stale.append(f"{file}: {name}")
        for path in re.findall(r"`{1,2}((?:veomni|models|tests|scripts|harness|recipes|examples)/[\w/.-]*)`",
                               (REPO / file).read_text(errors="replace")):
            path = path.rstrip("/.")
            folder, _, last = path.rpartition("/")
            module = f"{folder}/{last.split('.')[0]}.py"  # a/b.attr: an attribute of a/b.py
            if not (REPO / path).exists() and not (REPO / module).exists() and "_N" not in path:
                stale.append(f"{file}: {path}")
    assert not stale, "these files do not exist (renamed or moved?):\n" + "\n".join(sorted(set(stale)))


def test_the_counts_of_malformed_recipes_the_docs_state_are_the_tests():
    """The docs state how many malformed recipes and variants are refused; the lists grow (issue 47
    found 28 variants where the docs said 27), so each stated count is checked against its list."""
    from tests.config.test_bad_input_fuzz import CASES as VARIANTS
    from tests.config.test_bad_recipes import CASES as RECIPES

    stated = {doc: (REPO / "docs" / doc).read_text() for doc in ("testing.md", "fault_tolerance.md")}
    counts = [(int(n), what) for text in stated.values()
              for n, what in re.findall(r"(\d+) malformed (recipes|variants)", text)]
    assert counts, "the docs state no count of malformed recipes"
    assert all(n == {"recipes": len(RECIPES), "variants": len(VARIANTS)}[what] for n, what in counts), (
        counts, len(RECIPES), len(VARIANTS))
