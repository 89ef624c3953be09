"""The floor plan holds: no import cycle, every file small, and the package graph that
docs/design.md ("Import graph") draws is the one the code has, edge for edge."""

from __future__ import annotations

import re
from collections import defaultdict

from tests.house.imports import REPO, engine_package, module_graph, python_files

MAX_LINES = 400


def package_graph() -> dict[str, set[str]]:
    """Engine package (``veomni.train``) or zoo family (``models.llm``) -> those it imports."""
    def package(module: str) -> str:
        return engine_package(module) if module.startswith("veomni.") else ".".join(module.split(".")[:2])

    graph: dict[str, set[str]] = defaultdict(set)
    for module, imported in module_graph().items():
        if module == "models":  # the zoo's __init__ only registers the families
            continue
        graph[package(module)] |= {package(m) for m in imported if m != "models"} - {package(module)}
    return dict(graph)


def drawn_graph() -> dict[str, set[str]]:
    """The fenced block under "## Import graph" in docs/design.md: ``a -> b, c`` or ``a -> -``."""
    text = (REPO / "docs" / "design.md").read_text()
    block = re.search(r"## Import graph\n.*?```\n(.*?)```", text, re.S)
    assert block, "docs/design.md has no fenced block under '## Import graph'"
    drawn = {}
    for line in block.group(1).splitlines():
        if line.strip():
            source, _, targets = line.partition("->")
            drawn[source.strip()] = {t.strip() for t in targets.split(",") if t.strip() not in ("", "-")}
    return drawn


def _cycle(graph: dict[str, set[str]] | dict[str, frozenset[str]]) -> list[str]:
    """One import cycle of ``graph`` (empty when there is none), by depth-first search."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_no_module_imports_itself_through_others() -> None:
    cycle = _cycle(module_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_no_package_imports_itself_through_others() -> None:
    cycle = _cycle(package_graph())
    assert not cycle, "package cycle: " + " -> ".join(cycle)


def test_design_doc_draws_the_package_graph_the_code_has() -> None:
    drawn, real = drawn_graph(), package_graph()
    problems = [f"{p}: docs/design.md draws -> {', '.join(sorted(drawn.get(p, ()))) or '-'}, "
                f"the code has -> {', '.join(sorted(real.get(p, ()))) or '-'}"
                for p in sorted(set(drawn) | set(real)) if drawn.get(p, set()) != real.get(p, set())]
    assert not problems, "update the block under '## Import graph' in docs/design.md:\n" + "\n".join(problems)


def test_design_doc_lists_the_packages_ground_floor_first() -> None:
    """Read top to bottom, the block is the floor plan: each package imports only those above it."""
    seen: set[str] = set()
    late = []
    for package, imported in drawn_graph().items():
        late += [f"{package} -> {p}" for p in sorted(imported - seen)]
        seen.add(package)
    assert not late, "these edges point down the block (move the target above its importer):\n" + "\n".join(late)


def test_every_file_that_finds_the_repository_root_finds_it() -> None:
    """``Path(__file__).resolve().parents[k]`` must still be the root after a file moves folder."""
    wrong = [f"{path.relative_to(REPO)}: parents[{k}] is {path.resolve().parents[int(k)]}, the root is {REPO}"
             for path in python_files() for k in re.findall(r"Path\(__file__\)\.resolve\(\)\.parents\[(\d)\]",
                                                             path.read_text())
             if path.resolve().parents[int(k)] != REPO]
    assert not wrong, "\n".join(wrong)


def test_no_file_is_over_400_lines() -> None:
    long = [f"{path.relative_to(REPO)}: {n} lines" for path in python_files()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"split these files (one job each, at most {MAX_LINES} lines):\n" + "\n".join(long)
