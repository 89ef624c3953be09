"""Plant the bugs of the mutation list one at a time and check that the tests named for each catch it.

A test suite is only as good as the bugs it can see. ``tests/mutations.toml`` lists planted changes to
key formulas and contracts (an M-RoPE axis lost, a bias in the combine weights, a mask off by one...),
each with the fast-tier tests expected to fail on it. This script copies the repository's files
(tracked and untracked, not ignored) into a temporary folder once, then per mutation: replaces the
exact original text by the planted one in the copy, runs only that entry's tests there, and restores
the file. The working tree is never written to. It reports caught / missed per mutation and the catch
rate, and exits 1 if any mutation is missed, if its tests do not pass unmutated (``--baseline``), or if
an original text is no longer found exactly once (the list must follow the code it plants into).

    python scripts/mutate.py                       # the whole list
    python scripts/mutate.py mrope-width-as-height # some entries, by id
    python scripts/mutate.py --baseline            # also check that the listed tests pass unmutated

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


def _pytest(tree: Path, nodes: tuple[str, ...]) -> tuple[int, float, str]:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "WANDB_MODE": "disabled", "PYTHONDONTWRITEBYTECODE": "1"}  # no stale bytecode of a planted file
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *nodes],
                                cwd=tree, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, time.monotonic() - start, f"timed out after {TIMEOUT_S} s"
    lines = [line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return result.returncode, time.monotonic() - start, (lines[0] if lines else result.stdout.strip()[-300:])


def _verdict(code: int) -> str:
    """pytest's exit code: 1 a test failed (caught), 0 all passed (missed), -1 timed out (caught: a
    hang is a visible failure), 2 interrupted or a collection error, 3-5 a broken invocation."""
    return {0: "MISSED", 1: "caught", -1: "caught (timeout)", 2: "caught (collection error)"}.get(code, "ERROR")


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
    failed = 0
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        tree = Path(tmp)
        _copy_tree(tree)
        if args.baseline:
            nodes = tuple(dict.fromkeys(n for m in chosen for n in m.tests))
            code, seconds, detail = _pytest(tree, nodes)
            print(f"baseline: {len(nodes)} tests unmutated, exit {code}, {seconds:.0f} s")
            if code != 0:
                print(f"  the listed tests fail without any mutation: {detail}", file=sys.stderr)
                return 1
        for m in chosen:
            path = tree / m.file
            original = path.read_text()
            path.write_text(original.replace(m.original, m.replacement))
            try:
                code, seconds, detail = _pytest(tree, m.tests)
            finally:
                path.write_text(original)
            verdict = _verdict(code)
            failed += not verdict.startswith("caught")
            print(f"{verdict:<26} {m.id:<34} {seconds:5.0f} s  {detail if verdict != 'MISSED' else m.why}",
                  flush=True)
    caught = len(chosen) - failed
    print(f"catch rate: {caught}/{len(chosen)} ({100 * caught / len(chosen):.0f}%) in {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
