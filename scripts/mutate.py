"""Plant the bugs of the mutation list one at a time and check that the tests named for each catch it.

A test suite is only as good as the bugs it can see. ``tests/mutations.toml`` lists planted changes to
key formulas and contracts (an M-RoPE axis lost, a bias in the combine weights, a mask off by one...),
each with the fast-tier tests expected to fail on it. This script copies the repository's files
(tracked and untracked, not ignored) into a temporary folder once, then per mutation: replaces the
exact original text by the planted one in the copy, runs only that entry's tests there, and restores
the file. The working tree is never written to. A mutation is caught when every test listed for it
fails (each listed test claims to guard against it). It reports caught / missed per mutation, the
tests that passed with the bug planted, and the catch rate, and exits 1 if any mutation is missed,
if its tests do not pass unmutated (``--baseline``), or if an original text is no longer found
exactly once (the list must follow the code it plants into).

    python scripts/mutate.py                                 # the whole list
    python scripts/mutate.py mrope-width-turns-with-height   # some entries, by id
    python scripts/mutate.py --baseline                      # also check that the listed tests pass unmutated

Docs: docs/testing.md, "Planted bugs".
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIST = REPO / "tests" / "mutations.toml"
TIMEOUT_S = 300


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    original: str
    replacement: str
    tests: tuple[str, ...]
    why: str


def load(path: Path = LIST) -> list[Mutation]:
    """The entries of the list, in order; a malformed entry raises ``ValueError`` naming it."""
    entries = tomllib.loads(path.read_text())["mutation"]
    out = []
    for i, entry in enumerate(entries):
        missing = {"id", "file", "original", "replacement", "tests", "why"} - entry.keys()
        if missing:
            raise ValueError(f"{path.name}: entry {i} ({entry.get('id', '?')}) lacks {sorted(missing)}")
        out.append(Mutation(entry["id"], entry["file"], entry["original"], entry["replacement"],
                            tuple(entry["tests"]), entry["why"]))
    ids = [m.id for m in out]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path.name}: duplicate ids {sorted({i for i in ids if ids.count(i) > 1})}")
    return out


def problems(mutations: list[Mutation], root: Path = REPO) -> list[str]:
    """What keeps an entry from being planted: its file absent, its original text not found exactly
    once, a replacement equal to the original, no test, or a listed test's file absent."""
    found = []
    for m in mutations:
        path = root / m.file
        if not path.is_file():
            found.append(f"{m.id}: {m.file} does not exist")
            continue
        count = path.read_text().count(m.original)
        if count != 1:
            found.append(f"{m.id}: the original text occurs {count} times in {m.file} (must be once): "
                         "update the entry to the code")
        if m.original == m.replacement:
            found.append(f"{m.id}: the replacement equals the original")
        if not m.tests:
            found.append(f"{m.id}: no test listed")
        for node in m.tests:
            test_file, _, name = node.partition("::")
            if not (root / test_file).is_file():
                found.append(f"{m.id}: test file {test_file} does not exist")
            elif name and f"def {name.split('[')[0].split('::')[-1]}(" not in (root / test_file).read_text():
                found.append(f"{m.id}: {node} names no test function of {test_file}")
    return found


def _copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def _pytest(tree: Path, nodes: tuple[str, ...]) -> tuple[int, float, list[str]]:
    """Run ``nodes`` in ``tree``: pytest's exit code (-1 on a timeout), seconds, and its FAILED/ERROR lines."""
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "WANDB_MODE": "disabled", "PYTHONDONTWRITEBYTECODE": "1"}  # no stale bytecode of a planted file
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *nodes],
                                cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, time.monotonic() - start, [f"timed out after {TIMEOUT_S} s"]
    failed = [line for line in result.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return result.returncode, time.monotonic() - start, failed or [result.stdout.strip()[-300:]]


def _missed_by(code: int, nodes: tuple[str, ...], failed: list[str]) -> list[str]:
    """The listed tests that passed with the bug planted: every listed test must catch it (a failing
    parametrisation counts for its test); a timeout counts as caught by all, a broken run by none."""
    if code == -1:
        return []
    if code not in (0, 1):  # 2: interrupted or a collection error, 3-5: no such test, a bad invocation
        return list(nodes)
    names = [line.split()[1] for line in failed if len(line.split()) > 1]
    return [node for node in nodes if not any(name == node or name.startswith((node + "[", node + "::"))
                                              for name in names)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="entries to plant (default: all)")
    parser.add_argument("--baseline", action="store_true", help="first run every listed test unmutated")
    args = parser.parse_args(argv)
    mutations = load()
    unknown = set(args.ids) - {m.id for m in mutations}
    if unknown:
        print(f"unknown mutation ids: {sorted(unknown)}", file=sys.stderr)
        return 2
    chosen = [m for m in mutations if not args.ids or m.id in args.ids]
    broken = problems(chosen)
    if broken:
        print("the mutation list does not fit the code:\n  " + "\n  ".join(broken), file=sys.stderr)
        return 1
    start = time.monotonic()
    failed_ids = 0
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        if args.baseline:
            nodes = tuple(dict.fromkeys(n for m in chosen for n in m.tests))
            code, seconds, failed = _pytest(tree, nodes)
            print(f"baseline: {len(nodes)} tests unmutated, exit {code}, {seconds:.0f} s")
            if code != 0:
                print("  the listed tests fail without any mutation:\n  " + "\n  ".join(failed), file=sys.stderr)
                return 1
        for m in chosen:
            path = tree / m.file
            original = path.read_text()
            path.write_text(original.replace(m.original, m.replacement))
            try:
                code, seconds, failed = _pytest(tree, m.tests)
            finally:
                path.write_text(original)
            missed = _missed_by(code, m.tests, failed)
            failed_ids += bool(missed)
            verdict = (f"ERROR: pytest exit {code}" if code not in (-1, 0, 1) else
                       f"MISSED by {len(missed)}/{len(m.tests)}" if missed else f"caught by {len(m.tests)}")
            print(f"{verdict:<16} {m.id:<34} {seconds:4.0f} s  {failed[0][:150]}", flush=True)
            for node in missed:
                print(f"    passed with the bug planted: {node} ({m.why})", flush=True)
    caught = len(chosen) - failed_ids
    print(f"catch rate: {caught}/{len(chosen)} ({100 * caught / len(chosen):.0f}%) in {time.monotonic() - start:.0f} s")
    return 1 if failed_ids else 0


if __name__ == "__main__":
    sys.exit(main())
