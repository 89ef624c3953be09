"""The recipe reference lists every schema key, and the README starts with the two commands."""

import dataclasses
import re
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
