"""Build a graph folder (``veomni.data.graph.format``) for node classification.

Two kinds:

- ``stdlib-calls``: a real graph no one here wrote, built offline from the running Python's
  standard library. Nodes are its functions and methods (every ``def`` under
  ``sysconfig.get_paths()["stdlib"]``, without test folders, ``site-packages`` and ``idlelib``'s
  tests). An edge joins a function to each function it calls, resolved by name: a method of the
  caller's own class for ``self.name(...)``, else the functions of that name in the caller's
  module, else the one function of that name in the whole library when it is unique (ambiguous
  names like ``get`` stay unresolved); edges are undirected (both directions stored), without
  self-loops. The label is the function's top-level package or module (``email``, ``asyncio``,
  ``typing``...) for the ``--classes`` largest by function count (20: about 58% of the functions);
  the functions of the other modules stay in the graph, with their features and calls, as
  unlabelled nodes (label -1, in no split): a catch-all class of ~170 modules would be 40% of the
  nodes and teach nothing about packages.
  Features are a signed hashed bag of words (``--features`` dims, L2-normalised) of the function's
  name tokens, argument names, docstring words and the names it calls; never its module or
  class name, which would give the label away.
- ``sbm``: a stochastic block model: ``c`` equal communities (the classes), nodes in random id
  order, edges drawn per block pair with binomial counts so that a fraction ``h`` of the ``n * d / 2``
  undirected edges are inside a community; features are the class centroid (scaled by ``s``)
  plus unit Gaussian noise, so the features alone classify poorly and averaging over
  neighbours (mostly of the same class) classifies well. With ``b`` > 1 or ``w`` > 0 the graph has
  locality: ``b * c`` equal blocks on a ring (block k is of class k mod c), each of the ``n * d / 2``
  drawn edges joins a random node to a random node of its own block with probability ``h``, else of
  a block at most ``w`` steps along the ring (``w`` 0: any block); a BFS then sweeps along the ring,
  which is what BGL's proximity-aware order needs to make a feature cache hit.

Both split the labelled nodes 60/20/20 into train/val/test, stratified by class and seeded. The
graph is transductive: the train and eval data are the same folder (when ``--eval-out`` differs
from ``--train-out`` the folder is written to both).

The kind and its options come from the output folder's name, so that a recipe's ``data.prepare``
(which passes only the paths) builds what the path says, and graphs of different sizes never
share a cache: ``stdlib-calls``, or ``sbm-n<nodes>-d<avg degree>-c<classes>-f<features>-h<intra
fraction>-s<signal>`` (any subset of the keys, in any order; defaults below). Flags override the
name. Example::

    python data/build_graph.py --train-out data/cache/graphs/sbm-n100000-d20 \
        --eval-out data/cache/graphs/sbm-n100000-d20
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import sys
import sysconfig
import time
import zlib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from veomni.data.builders import build_once
from veomni.data.graph.format import UNLABELLED, GraphData, save_graph

FORMAT_VERSION = 1
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
SBM_OPTIONS = {"n": ("nodes", int, 20_000), "d": ("avg-degree", float, 10.0), "c": ("communities", int, 8),
               "f": ("sbm-features", int, 64), "h": ("intra-fraction", float, 0.8), "s": ("signal", float, 0.15),
               "b": ("blocks-per-class", int, 1), "w": ("ring-window", int, 0)}
"""Folder-name key -> (flag, type, default)."""
SPLIT = (0.6, 0.2)
"""Train and validation fractions of each class; the rest is test."""


# ----- shared: splits, statistics ----------------------------------------------------------------
def stratified_masks(y: torch.Tensor, num_classes: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(train, val, test) masks: each class's nodes shuffled (seeded) and cut 60/20/20."""
    generator = torch.Generator().manual_seed(seed)
    masks = [torch.zeros_like(y, dtype=torch.bool) for _ in range(3)]
    for c in range(num_classes):
        nodes = (y == c).nonzero().squeeze(1)
        nodes = nodes[torch.randperm(nodes.numel(), generator=generator)]
        n_train, n_val = round(SPLIT[0] * nodes.numel()), round(SPLIT[1] * nodes.numel())
        for mask, part in zip(masks, (nodes[:n_train], nodes[n_train:n_train + n_val], nodes[n_train + n_val:])):
            mask[part] = True
    return tuple(masks)


def homophily(graph: GraphData) -> float:
    """The fraction of edges between labelled nodes whose ends share a label."""
    src, dst = graph.edge_index
    labelled = (graph.y[src] != UNLABELLED) & (graph.y[dst] != UNLABELLED)
    return float((graph.y[src] == graph.y[dst])[labelled].double().mean()) if labelled.any() else 0.0


def centroid_accuracy(graph: GraphData, x: torch.Tensor) -> float:
    """Test accuracy of the nearest class centroid (cosine) of the training nodes' rows of ``x``."""
    centroids = torch.zeros(graph.num_classes, x.shape[1]).index_add_(0, graph.y[graph.train_mask],
                                                                      x[graph.train_mask])
    scores = torch.nn.functional.normalize(x[graph.test_mask], dim=1) @ torch.nn.functional.normalize(centroids,
                                                                                                      dim=1).T
    return float((scores.argmax(1) == graph.y[graph.test_mask]).double().mean())


def stats(graph: GraphData) -> dict:
    """What the builder prints and stores in the manifest: sizes, homophily, and how well a
    nearest-centroid classifier does on the features alone vs. averaged over neighbours."""
    src, dst = graph.edge_index
    degree = torch.bincount(dst, minlength=graph.num_nodes).clamp(min=1).unsqueeze(1).float()
    neighbour_mean = torch.zeros_like(graph.x).index_add_(0, dst, graph.x[src]) / degree
    counts = torch.bincount(graph.y[graph.y != UNLABELLED], minlength=graph.num_classes)
    return {
        "homophily": round(homophily(graph), 4),
        "labelled_nodes": int(counts.sum()),
        "isolated_nodes": int((torch.bincount(graph.edge_index.flatten(), minlength=graph.num_nodes) == 0).sum()),
        "class_sizes": counts.tolist(),
        "majority_test_accuracy": round(float((graph.y[graph.test_mask] == counts.argmax()).double().mean()), 4),
        "centroid_test_accuracy_features": round(centroid_accuracy(graph, graph.x), 4),
        "centroid_test_accuracy_neighbour_mean": round(centroid_accuracy(graph, graph.x + neighbour_mean), 4),
    }


def undirected(pairs: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """[2, E] pairs -> both directions of each distinct non-loop pair, sorted by (dst, src)."""
    a, b = pairs[0].long(), pairs[1].long()
    keep = a != b
    lo, hi = torch.minimum(a[keep], b[keep]), torch.maximum(a[keep], b[keep])
    key = torch.unique(lo * num_nodes + hi)
    lo, hi = key // num_nodes, key % num_nodes
    both = torch.cat([torch.stack([lo, hi]), torch.stack([hi, lo])], dim=1)
    return both[:, torch.argsort(both[1] * num_nodes + both[0])]


# ----- sbm ---------------------------------------------------------------------------------------
def ring_pairs(block: torch.Tensor, blocks: int, m: int, h: float, w: int, generator: torch.Generator) -> torch.Tensor:
    """[2, m] node pairs of the ring of blocks (module docstring), fully vectorised."""
    members = torch.argsort(block, stable=True)
    sizes = torch.bincount(block, minlength=blocks)
    starts = torch.cumsum(sizes, 0) - sizes
    one = torch.randint(block.numel(), (m,), generator=generator)
    reach = w if w else blocks - 1
    sign = 1 - 2 * torch.randint(2, (m,), generator=generator)
    step = torch.randint(1, reach + 1, (m,), generator=generator) * sign
    other = (block[one] + torch.where(torch.rand(m, generator=generator) < h, 0, step)) % blocks
    return torch.stack([one, members[starts[other] + (torch.rand(m, generator=generator) * sizes[other]).long()]])


def sbm_graph(n: int, d: float, c: int, f: int, h: float, s: float, seed: int, b: int = 1, w: int = 0) -> GraphData:
    """The stochastic block model of the module docstring (a ring of blocks with ``b``, ``w``), vectorised."""
    generator = torch.Generator().manual_seed(seed)
    y = (torch.arange(n) * c // n)[torch.randperm(n, generator=generator)]  # equal communities, random ids
    if b > 1 or w:
        block = (torch.arange(n) * (b * c) // n)[torch.randperm(n, generator=generator)]
        y = block % c
        return _sbm_data(y, undirected(ring_pairs(block, b * c, int(n * d / 2), h, w, generator), n), c, f, s, seed,
                         f"sbm-n{n}-d{d:g}-c{c}-f{f}-h{h:g}-s{s:g}-b{b}-w{w}",
                         f"{b * c} blocks on a ring ({b} per class), average degree {d:g}, {h:.0%} of edges inside a "
                         f"block, the rest to a block at most {w or b * c} steps away", generator)
    members = torch.argsort(y, stable=True)
    sizes = torch.bincount(y, minlength=c).double()
    starts = torch.cumsum(sizes, 0) - sizes
    inside = sizes * (sizes - 1) / 2
    across = (sizes.sum() ** 2 - (sizes ** 2).sum()) / 2
    p_in, p_out = h * n * d / 2 / inside.sum(), (1 - h) * n * d / 2 / across
    blocks = [(a, b, inside[a] if a == b else sizes[a] * sizes[b], p_in if a == b else p_out)
              for a in range(c) for b in range(a, c)]
    pairs = []
    for a, b, possible, p in blocks:
        count = int(torch.binomial(possible.reshape(1), torch.tensor([min(float(p), 1.0)], dtype=torch.float64),
                                   generator=generator))
        ends = [starts[k] + torch.floor(torch.rand(count, generator=generator, dtype=torch.float64) * sizes[k])
                for k in (a, b)]
        pairs.append(members[torch.stack(ends).long()])
    return _sbm_data(y, undirected(torch.cat(pairs, dim=1), n), c, f, s, seed,
                     f"sbm-n{n}-d{d:g}-c{c}-f{f}-h{h:g}-s{s:g}",
                     f"{c} communities, average degree {d:g}, {h:.0%} of edges inside a community", generator)


def _sbm_data(y: torch.Tensor, edge_index: torch.Tensor, c: int, f: int, s: float, seed: int, name: str, shape: str,
              generator: torch.Generator) -> GraphData:
    """The graph with its features (noisy class centroids) and stratified splits."""
    n = y.numel()
    centroids = torch.randn(c, f, generator=generator)
    x = s * centroids[y] + torch.randn(n, f, generator=generator)
    masks = stratified_masks(y, c, seed)
    return GraphData(x, y, edge_index, *masks, num_classes=c, name=name,
                     description=f"stochastic block model: {shape}; features = {s:g} x class centroid + N(0, 1) noise",
                     source=f"generated by data/build_graph.py (seed {seed})",
                     class_names=[f"community {k}" for k in range(c)])


# ----- stdlib call graph -------------------------------------------------------------------------
@dataclass
class Function:
    module: str
    cls: str | None
    name: str
    words: list[str]
    calls: list[tuple[str, bool]]
    """(called name, called as ``self.name``)."""


WORD = re.compile(r"[A-Za-z][a-z]+|[A-Z]+(?![a-z])|[0-9]+")


def tokens(identifier: str) -> list[str]:
    """``getHTTPResponse_code`` -> ``get http response code``."""
    return [w.lower() for w in WORD.findall(identifier)]


def stdlib_files(limit: int | None) -> list[tuple[str, Path]]:
    """(dotted module name, path) of the stdlib's sources, sorted; the first ``limit`` only."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and "." not in d and "-" not in d)
        for filename in sorted(filenames):
            if filename.endswith(".py"):
                parts = (Path(dirpath) / filename).relative_to(root).with_suffix("").parts
                module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found.append((module, Path(dirpath) / filename))
    return found[:limit]


class _Collector(ast.NodeVisitor):
    """Every function of one module with its text and the names it calls (a nested def is a
    function of its own: its calls are its own, not its parent's)."""

    def __init__(self, module: str) -> None:
        self.module, self.cls, self.functions = module, None, []
        self.current: Function | None = None

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        outer, self.cls = self.cls, node.name
        self.generic_visit(node)
        self.cls = outer

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = node.args
        arguments = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                     *filter(None, (args.vararg, args.kwarg))) if a.arg not in ("self", "cls")]
        docstring = ast.get_docstring(node) or ""
        words = tokens(node.name) + [w for a in arguments for w in tokens(a)] + tokens(docstring)[:200]
        function = Function(self.module, self.cls, node.name, words, [])
        self.functions.append(function)
        outer, outer_cls, self.current, self.cls = self.current, self.cls, function, None
        self.generic_visit(node)
        self.current, self.cls = outer, outer_cls

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Call(self, node: ast.Call) -> None:
        if self.current is not None:
            target = node.func
            if isinstance(target, ast.Name):
                self.current.calls.append((target.id, False))
            elif isinstance(target, ast.Attribute):
                is_self = isinstance(target.value, ast.Name) and target.value.id == "self"
                self.current.calls.append((target.attr, is_self))
        self.generic_visit(node)


def collect_functions(limit: int | None) -> list[Function]:
    functions = []
    for module, path in stdlib_files(limit):
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError, OSError):  # a few stdlib files are templates or Python 2
            continue
        collector = _Collector(module)
        collector.visit(tree)
        functions += collector.functions
    return functions


def resolve_calls(functions: list[Function]) -> torch.Tensor:
    """[2, E] (caller, callee) pairs by the module docstring's name rules."""
    by_class: dict[tuple[str, str | None, str], list[int]] = defaultdict(list)
    by_module: dict[tuple[str, str], list[int]] = defaultdict(list)
    by_name: dict[str, list[int]] = defaultdict(list)
    for i, fn in enumerate(functions):
        by_class[fn.module, fn.cls, fn.name].append(i)
        by_module[fn.module, fn.name].append(i)
        by_name[fn.name].append(i)
    pairs = []
    for i, fn in enumerate(functions):
        for name, is_self in set(fn.calls):
            callees = (by_class.get((fn.module, fn.cls, name)) if is_self else None) or by_module.get((fn.module, name))
            if not callees and len(by_name.get(name, ())) == 1:
                callees = by_name[name]
            pairs += [(i, j) for j in callees or ()]
    return torch.tensor(pairs, dtype=torch.long).T.reshape(2, -1)


def hashed_features(functions: list[Function], dims: int) -> torch.Tensor:
    """Signed hashed bag of words (crc32: the same on every run and machine), L2-normalised rows."""
    rows, columns, signs = [], [], []
    for i, fn in enumerate(functions):
        for word in fn.words + [w for name, _ in fn.calls for w in tokens(name)]:
            code = zlib.crc32(word.encode())
            rows.append(i)
            columns.append(code % dims)
            signs.append(1.0 if (code >> 31) & 1 else -1.0)
    x = torch.zeros(len(functions), dims)
    x.index_put_((torch.tensor(rows, dtype=torch.long), torch.tensor(columns, dtype=torch.long)),
                 torch.tensor(signs), accumulate=True)
    return torch.nn.functional.normalize(x, dim=1)


def stdlib_call_graph(classes: int, features: int, seed: int, max_files: int | None = None) -> GraphData:
    functions = collect_functions(max_files)
    if not functions:
        sys.exit("no Python sources found under the stdlib folder " + sysconfig.get_paths()["stdlib"])
    top = [fn.module.split(".")[0] for fn in functions]
    class_names = sorted(name for name, _ in Counter(top).most_common(classes))
    index = {name: k for k, name in enumerate(class_names)}
    y = torch.tensor([index.get(name, UNLABELLED) for name in top], dtype=torch.long)
    edge_index = undirected(resolve_calls(functions), len(functions))
    masks = stratified_masks(y, len(class_names), seed)
    version = sys.version.split()[0]
    return GraphData(hashed_features(functions, features), y, edge_index, *masks, num_classes=len(class_names),
                     name="stdlib-calls",
                     description=f"call graph of the Python {version} standard library's functions and methods, "
                                 f"labelled by top-level package (the {classes} largest; other functions "
                                 "unlabelled); features: hashed bag of words of names, arguments, docstrings and "
                                 "called names",
                     source=f"{sysconfig.get_paths()['stdlib']} (Python {version})" +
                            (f", first {max_files} files" if max_files else ""),
                     class_names=class_names)


# ----- command line ------------------------------------------------------------------------------
def options_from_name(folder: Path) -> dict:
    """The kind and options a folder name asks for (the module docstring's grammar)."""
    name = folder.name
    if name.startswith("stdlib-calls"):
        return {"kind": "stdlib-calls"}
    if not name.startswith("sbm"):
        return {}
    options: dict = {"kind": "sbm"}
    for part in name.split("-")[1:]:
        key, value = part[:1], part[1:]
        if key not in SBM_OPTIONS:
            sys.exit(f"{folder}: unknown sbm option {part!r} in the folder name; keys: {', '.join(SBM_OPTIONS)}")
        options[key] = SBM_OPTIONS[key][1](value)
    return options


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-out", required=True, type=Path)
    parser.add_argument("--eval-out", type=Path, help="defaults to --train-out (the graph is transductive)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--kind", choices=("sbm", "stdlib-calls"), help="default: from the folder name")
    for key, (flag, kind, default) in SBM_OPTIONS.items():
        parser.add_argument(f"--{flag}", dest=key, type=kind, help=f"sbm: default from the folder name, else {default}")
    parser.add_argument("--classes", type=int, default=20, help="stdlib-calls: the largest packages labelled")
    parser.add_argument("--features", type=int, default=256, help="stdlib-calls: hashed feature dims")
    parser.add_argument("--max-files", type=int, help="stdlib-calls: parse only the first N files (tests)")
    args = parser.parse_args(argv)
    eval_out = args.eval_out or args.train_out
    named = options_from_name(args.train_out)
    kind = args.kind or named.get("kind")
    if kind is None:
        parser.error(f"--kind is needed: the folder name {args.train_out.name!r} names no kind "
                     "(stdlib-calls or sbm-...)")
    build_once(args.train_out, eval_out, FORMAT_VERSION, lambda: build(args, kind, named, eval_out))


def build(args: argparse.Namespace, kind: str, named: dict, eval_out: Path) -> None:
    start = time.perf_counter()
    if kind == "sbm":
        options = {key: named.get(key, default) if getattr(args, key) is None else getattr(args, key)
                   for key, (_, _, default) in SBM_OPTIONS.items()}
        graph = sbm_graph(**options, seed=args.seed)
    else:
        graph = stdlib_call_graph(args.classes, args.features, args.seed, args.max_files)
    built = time.perf_counter() - start
    summary = stats(graph)
    save_graph(args.train_out, graph, format_version=FORMAT_VERSION, build_seconds=round(built, 1), stats=summary)
    if eval_out != args.train_out:
        shutil.rmtree(eval_out, ignore_errors=True)
        shutil.copytree(args.train_out, eval_out)
    print(f"{args.train_out}: {graph.name}: {graph.num_nodes} nodes, {graph.num_edges} directed edges, "
          f"{graph.num_features} features, {graph.num_classes} classes; built in {built:.1f}s")
    for key, value in summary.items():
        print(f"  {key}: {value}")


if __name__ == "__main__":
    main()
