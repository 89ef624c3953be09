"""The public API for plug-in authors (``veomni.plugin_api``) changes only on purpose.

Every name it exports is importable and has the signature stored in ``plugin_api_signatures.txt``
beside this file (functions: their parameters; classes: their constructor, their public methods
and annotated attributes, each on its own line; constants: their value). A change to any of them
fails here: when it is meant, regenerate the file (the command is in the failure message) and add a
line to CHANGELOG.md, keeping the old name working for one release where it can
(``veomni/contract/deprecated.py``). Every exported name is also named in docs/adding_a_model.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import sys
from pathlib import Path

import veomni.plugin_api as api

REPO = Path(__file__).resolve().parents[2]
SNAPSHOT = Path(__file__).with_name("plugin_api_signatures.txt")
CONFIG_SECTIONS = {"DataConfig"}
"""Recipe sections: their fields are configuration keys (docs/configuration.md, held to the schema by
tests/house), not API, so only the class itself is listed."""


def _signature(obj) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(no signature)"
    return re.sub(r" at 0x[0-9a-f]+>", ">", text)  # a default function's address changes every run


def _annotation(annotation) -> str:
    if isinstance(annotation, str):
        return annotation
    return getattr(annotation, "__forward_arg__", None) or inspect.formatannotation(annotation)


def _class_lines(name: str, cls: type) -> list[str]:
    """The constructor, annotated attributes (a NamedTuple's fields) and public methods a class defines
    itself (inherited members are their own classes' business: a plug-in's ``nn.Module`` API is torch's)."""
    if name in CONFIG_SECTIONS:
        return []
    own = vars(cls)
    fields = {field.name for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    lines = [f"{name}.{attr}: {_annotation(annotation)}" for attr, annotation in own.get("__annotations__", {}).items()]
    for member in sorted(set(own) - fields):  # a field's default (a function) is no method
        value = own[member]
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        public = not member.startswith("_") or member in ("__init__", "__call__")
        if callable(value) and public and getattr(value, "__name__", "") != "_no_init_or_replace_init":
            lines.append(f"{name}.{member}{_signature(value)}")
    return lines


def api_lines() -> list[str]:
    """One line per exported name and per member, in ``__all__``'s order."""
    lines = []
    for name in api.__all__:
        obj = getattr(api, name)
        if inspect.isclass(obj):
            bases = ", ".join(base.__name__ for base in obj.__bases__)
            lines += [f"class {name}({bases})", *_class_lines(name, obj)]
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            lines.append(f"def {name}{_signature(obj)}")
        else:
            lines.append(f"{name} = {obj!r}")
    return lines


def test_every_name_is_importable_from_the_one_module():
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert not missing and len(set(api.__all__)) == len(api.__all__), missing


def test_the_signatures_equal_the_stored_snapshot():
    stored, now = SNAPSHOT.read_text().splitlines(), api_lines()
    diff = "\n".join(difflib.unified_diff(stored, now, "stored", "now", lineterm="", n=0))
    assert stored == now, (
        "the plug-in API changed (veomni/plugin_api.py):\n" + diff + "\nIf that is meant: add a line to "
        "CHANGELOG.md (Changed / Removed / Deprecated), keep the old name working for one release where it can "
        "(veomni/contract/deprecated.py), then store the new snapshot with\n"
        f"  PYTHONPATH=. python {Path(__file__).relative_to(REPO)} > {SNAPSHOT.relative_to(REPO)}")


def test_every_name_is_documented_for_plugin_authors():
    doc = (REPO / "docs" / "adding_a_model.md").read_text()
    undocumented = [name for name in api.__all__ if f"`{name}" not in doc and f"{name}`" not in doc
                    and f"{name}(" not in doc]
    assert not undocumented, f"docs/adding_a_model.md does not name: {', '.join(undocumented)}"


if __name__ == "__main__":
    sys.stdout.write("\n".join(api_lines()) + "\n")
