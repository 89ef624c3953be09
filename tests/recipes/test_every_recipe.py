"""Every recipe runs (or, for a cluster's, plans) with the one command its header gives, on a fresh clone.

The header of each recipe under ``recipes/`` and ``examples/`` names its command (``bash
scripts/train.sh RECIPE [ARGS]``). The tracked files are copied to a folder of their own (a fresh
clone: no data built, no pretrained folder, no outputs), and the launcher's check runs there, in this
process, as ``--dry-run`` (a command that plans already is one; one that trains is planned for
``train.sh``'s 2 CPU processes). Its exit status must be 0, and a recipe that trains must need no
input that neither the clone ships nor a builder of the recipe makes (``data.prepare``,
``data.sources[i].prepare``, ``checkpoint.prepare``): the dry run names each such data input
(``veomni.launch.NOTHING_BUILDS``) and refuses such a pretrained folder. Only the command line's own
paths (a user's pretrained folder and tokenizer, ``/ckpt/...``) may be missing: a recipe whose
command names them is refused for those folders and nothing else.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from veomni import launch

pytestmark = pytest.mark.full  # ~40 recipes planned in one process: the full tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.relative_to(REPO) for p in [*(REPO / "recipes").rglob("*.yaml"),
                                               *(REPO / "examples").rglob("recipe*.yaml")])


SHELL_OPERATORS = ("&&", "||", ";", "|")


def one_command(recipe: Path) -> list[str]:
    """The arguments after the recipe in the first ``bash scripts/train.sh RECIPE`` of its header
    (continued lines joined, ``[optional]`` parts and trailing comments dropped, up to a shell
    operator that chains the next command: ``train.sh ... && bash scripts/eval_chat.sh ...``)."""
    header = []
    for line in (REPO / recipe).read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:])
    text = "\n".join(header).replace("\\\n", " ")
    found = re.search(rf"bash scripts/train\.sh {re.escape(str(recipe))}([^\n]*)", text)
    assert found, f"{recipe}: its header names no command (# bash scripts/train.sh {recipe} ...)"
    args = shlex.split(re.sub(r"\[[^\]]*\]", "", found.group(1)), comments=True)
    ends = [i for i, arg in enumerate(args) if arg in SHELL_OPERATORS]
    return args[:ends[0]] if ends else args


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files alone, as ``git clone`` would leave them."""
    root = tmp_path_factory.mktemp("clone")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in tracked.splitlines():
        if (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)
    return root


def _unbuilt(err: str) -> list[str]:
    """The inputs the dry run said nothing builds."""
    lines = re.findall(rf"{launch.NOTHING_BUILDS} (.*?): planned without it", err)
    return [part.rsplit(" (", 1)[0] for line in lines for part in line.split(", ")]


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_the_recipe_runs_with_its_one_command_on_a_fresh_clone(recipe, clone, capsys):
    args = one_command(recipe)
    plan = args if "--dry-run" in args else [*args, "--dry-run", "--world-size", "2"]
    status = launch.main([str(clone / recipe), *plan])
    err = capsys.readouterr().err
    errors = re.findall(r"config error: (.*)", err)
    users_own = [arg for arg in args if arg.startswith("/")]
    only_users_own = [e for e in errors if not any(e.endswith(f"folder does not exist: {p}") for p in users_own)] == []
    assert status == 0 or (errors and only_users_own), (
        f"bash scripts/train.sh {recipe} {shlex.join(args)} on a fresh clone:\n{err[-3000:]}")
    if "--dry-run" not in args:
        needed = [path for path in _unbuilt(err) if path not in args]
        assert not needed, (f"{recipe} needs {needed}, which a fresh clone lacks and no builder of the recipe "
                            "makes: add a data.prepare / checkpoint.prepare, or pass it in the header's command")
