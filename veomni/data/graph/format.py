"""The on-disk format of one graph for node classification, and the checks a launch runs on it.

Why a format of our own: a graph (features, labels, splits, edges) is one object that every rank
reads whole, so it is one ``safetensors`` file plus a ``manifest.json`` that says what it holds
and lets a launcher check it (sizes, class count, checksums) without reading the tensors.

A graph folder::

    manifest.json       {"format": "veomni-graph/1", "name", "description", "source",
                         "num_nodes", "num_edges", "num_features", "num_classes",
                         "class_names" (optional), "files": {"graph.safetensors":
                         {"bytes", "sha256"}}, ...}  (builders add their own keys, e.g.
                         ``format_version`` for ``veomni.data.builders``' cache and stats)
    graph.safetensors   x float32 [N, F]; y int64 [N] (-1: unlabelled, in no split); edge_index int64 [2, E] (row 0 the
                         source, row 1 the destination; an undirected graph stores both
                         directions); train_mask, val_mask, test_mask bool [N] (disjoint);
                         optionally edge_weight float32 [E] (finite, > 0; 1 when absent)

``save_graph`` writes a hidden sibling folder and renames it into place, so a reader sees the old
graph or the whole new one. ``load_graph`` verifies the file's size and sha256 before parsing it
(a corrupt file fails there, naming the file); ``check_graph`` lists what is wrong with the
contents: edges past the node count, overlapping masks, non-finite features, labels outside the
classes, shapes, and a manifest that disagrees with the tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from veomni.errors import BadData

FORMAT = "veomni-graph/1"
MANIFEST = "manifest.json"
TENSORS = "graph.safetensors"
MASKS = ("train_mask", "val_mask", "test_mask")
FIELDS = ("x", "y", "edge_index", *MASKS)
EDGE_WEIGHT = "edge_weight"
"""The optional tensor: one weight per edge, which the layers' neighbour normalisation scales by."""
UNLABELLED = -1
"""The label of a node in no split: it carries features and edges but is never a loss target."""
REBUILD_HINT = ("rewrite the folder: your own graph with veomni.data.graph.writer.write_graph_folder (format: "
                "docs/data.md), a built one with its builder (data/build_graph.py, or delete it and let "
                "data.prepare run)")


class GraphFormatError(BadData):
    """A graph folder that cannot be trained on; the message lists every problem found."""


@dataclass
class GraphData:
    """One graph in memory; ``manifest`` holds the metadata (``load_graph`` fills it from disk)."""

    x: torch.Tensor
    y: torch.Tensor
    edge_index: torch.Tensor
    train_mask: torch.Tensor
    val_mask: torch.Tensor
    test_mask: torch.Tensor
    num_classes: int
    name: str = "graph"
    description: str = ""
    source: str = ""
    class_names: list[str] | None = None
    manifest: dict[str, Any] = field(default_factory=dict)
    folder: Path | None = None
    edge_weight: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return self.x.shape[0]

    @property
    def num_edges(self) -> int:
        return self.edge_index.shape[1]

    @property
    def num_features(self) -> int:
        return self.x.shape[1] if self.x.dim() == 2 else 0

    def tensors(self) -> dict[str, torch.Tensor]:
        names = (*FIELDS, EDGE_WEIGHT) if self.edge_weight is not None else FIELDS
        return {name: getattr(self, name) for name in names}

    def where(self) -> str:
        return str(self.folder) if self.folder is not None else f"graph {self.name!r}"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def describe(graph: GraphData) -> dict[str, Any]:
    """The manifest fields the tensors determine."""
    described = {
        "format": FORMAT, "name": graph.name, "description": graph.description, "source": graph.source,
        "num_nodes": graph.num_nodes, "num_edges": graph.num_edges, "num_features": graph.num_features,
        "num_classes": graph.num_classes,
    }
    if graph.class_names is not None:
        described["class_names"] = list(graph.class_names)
    return described


def save_graph(folder: str | Path, graph: GraphData, **extra: Any) -> Path:
    """Write ``graph`` (checked first) as a graph folder, atomically; ``extra`` joins the manifest.

    An existing ``folder`` is replaced only when it holds nothing but a graph's two files, so a
    mistyped path never deletes someone's data.
    """
    folder = Path(folder)
    problems = check_graph(graph, against_manifest=False)
    if problems:
        raise GraphFormatError(f"not writing {folder}: " + "; ".join(problems))
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {name: t.contiguous() for name, t in graph.tensors().items()}
    save_file(tensors, str(tmp / TENSORS), metadata={"format": FORMAT})
    files = {TENSORS: {"bytes": (tmp / TENSORS).stat().st_size, "sha256": sha256(tmp / TENSORS)}}
    manifest = {**describe(graph), "files": files, **extra}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if folder.exists():
        foreign = sorted(p.name for p in folder.iterdir() if p.name not in (MANIFEST, TENSORS))
        if foreign:
            shutil.rmtree(tmp)
            raise GraphFormatError(f"{folder} holds files that are not a graph's ({foreign[:3]}); "
                                   "remove them or write elsewhere")
        shutil.rmtree(folder)
    tmp.rename(folder)
    return folder


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The folder's manifest, or a ``GraphFormatError`` saying what is missing."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise GraphFormatError(f"{path} not found: not a graph folder ({REBUILD_HINT})") from None
    except ValueError as exc:
        raise GraphFormatError(f"{path} is not valid JSON ({exc}); {REBUILD_HINT}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise GraphFormatError(f"{path}: format is {found!r}, expected {FORMAT!r}; {REBUILD_HINT}")
    return manifest


def file_problems(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """Missing files and files whose size or sha256 differ from the manifest (corrupt or edited)."""
    files = manifest.get("files", {})
    if TENSORS not in files:
        return [f"{folder / MANIFEST} lists no {TENSORS}; {REBUILD_HINT}"]
    problems = []
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            problems.append(f"{path} is missing; {REBUILD_HINT}")
        elif path.stat().st_size != expected.get("bytes"):
            problems.append(f"{path} has {path.stat().st_size} bytes, the manifest says {expected.get('bytes')} "
                            f"(truncated or replaced); {REBUILD_HINT}")
        elif sha256(path) != expected.get("sha256"):
            problems.append(f"{path}: sha256 differs from the manifest's (the file is corrupt); {REBUILD_HINT}")
    return problems


def mapped_tensor(path: Path, name: str) -> torch.Tensor:
    """Tensor ``name`` of a safetensors file as a copy-on-write memory map of the file: nothing is
    read until its elements are, and then only their pages (sampled training's feature rows)."""
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        info = json.loads(handle.read(length))[name]
    dtypes = {"F32": numpy.float32, "F16": numpy.float16, "F64": numpy.float64}
    if info["dtype"] not in dtypes:
        raise GraphFormatError(f"{path}: {name} is {info['dtype']}; memory-mapped features are F32, F16 or F64")
    array = numpy.memmap(path, dtype=dtypes[info["dtype"]], mode="c", offset=8 + length + info["data_offsets"][0],
                         shape=tuple(info["shape"]))
    return torch.from_numpy(array)


def _read_tensors(path: Path, map_features: bool) -> dict[str, torch.Tensor]:
    if not map_features:
        return load_file(str(path))
    with safe_open(str(path), framework="pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys() if name != "x"}
        mapped = "x" in handle.keys()
    return {**tensors, "x": mapped_tensor(path, "x")} if mapped else tensors


def load_graph(folder: str | Path, map_features: bool = False) -> GraphData:
    """Read a graph folder; its files are verified against the manifest's sizes and checksums
    first. The contents are not checked here: call ``check_graph`` (the dataset kind does).
    ``map_features``: ``x`` is memory-mapped (``mapped_tensor``), not read into memory."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    problems = file_problems(folder, manifest)
    if problems:
        raise GraphFormatError("; ".join(problems))
    try:
        tensors = _read_tensors(folder / TENSORS, map_features)
    except SafetensorError as exc:
        raise GraphFormatError(f"{folder / TENSORS} does not parse ({exc}); {REBUILD_HINT}") from None
    missing = [name for name in FIELDS if name not in tensors]
    if missing:
        raise GraphFormatError(f"{folder / TENSORS} lacks {missing} (it holds {sorted(tensors)}); {REBUILD_HINT}")
    return GraphData(**{name: tensors[name] for name in FIELDS}, edge_weight=tensors.get(EDGE_WEIGHT),
                     num_classes=int(manifest.get("num_classes", -1)),
                     name=manifest.get("name", folder.name), description=manifest.get("description", ""),
                     source=manifest.get("source", ""), class_names=manifest.get("class_names"),
                     manifest=manifest, folder=folder)


def check_graph(graph: GraphData, against_manifest: bool = True) -> list[str]:
    """Every problem with the contents, as messages naming the graph and how to fix it; [] when
    it can be trained on. ``against_manifest``: also compare the tensors with ``graph.manifest``."""
    where, n = graph.where(), graph.num_nodes
    problems = _shape_problems(graph)
    if problems:  # the value checks below index by these shapes
        return [f"{where}: {p}" for p in problems]
    src_dst = graph.edge_index
    if src_dst.numel() and (int(src_dst.min()) < 0 or int(src_dst.max()) >= n):
        bad = ((src_dst < 0) | (src_dst >= n)).any(0)
        problems.append(f"{int(bad.sum())} edges point outside the {n} nodes (largest id {int(src_dst.max())}, "
                        f"smallest {int(src_dst.min())}): edge_index must hold ids in [0, num_nodes)")
    for i, a in enumerate(MASKS):
        for b in MASKS[i + 1:]:
            both = int((getattr(graph, a) & getattr(graph, b)).sum())
            if both:
                problems.append(f"{a} and {b} overlap on {both} nodes: a node belongs to at most one split")
    if graph.edge_weight is not None and not bool((torch.isfinite(graph.edge_weight) & (graph.edge_weight > 0)).all()):
        problems.append("edge_weight holds weights that are not finite and > 0: drop those edges instead")
    bad_rows = int((~torch.isfinite(graph.x)).any(1).sum())
    if bad_rows:
        problems.append(f"{bad_rows} rows of x hold NaN or inf: fix or drop those nodes' features")
    if graph.num_classes < 1:
        problems.append(f"num_classes is {graph.num_classes}: it must be >= 1")
    outside = (graph.y < UNLABELLED) | (graph.y >= graph.num_classes)
    if outside.any():
        problems.append(f"{int(outside.sum())} labels lie outside [0, {graph.num_classes}) (e.g. "
                        f"{int(graph.y[outside][0])}): relabel them, raise num_classes, or mark them -1 (unlabelled)")
    for mask in MASKS:
        unlabelled = int((getattr(graph, mask) & (graph.y == UNLABELLED)).sum())
        if unlabelled:
            problems.append(f"{unlabelled} nodes of {mask} have no label (-1): take them out of the split")
    if graph.class_names is not None and len(graph.class_names) != graph.num_classes:
        problems.append(f"{len(graph.class_names)} class_names for {graph.num_classes} classes")
    if against_manifest and graph.manifest:
        described = describe(graph)
        problems += [f"the manifest says {key}={graph.manifest.get(key)!r}, the tensors give {value!r} "
                     f"(edited by hand?); {REBUILD_HINT}"
                     for key, value in described.items()
                     if key in ("num_nodes", "num_edges", "num_features") and graph.manifest.get(key) != value]
    return [f"{where}: {p}" for p in problems]


def _shape_problems(graph: GraphData) -> list[str]:
    n = graph.num_nodes
    expected = {"x": (torch.float32, 2), "y": (torch.int64, 1), "edge_index": (torch.int64, 2),
                **{mask: (torch.bool, 1) for mask in MASKS}, EDGE_WEIGHT: (torch.float32, 1)}
    problems = [f"{name} is {t.dtype} with {t.dim()} dims, expected {dtype} with {dims}"
                for name, t in graph.tensors().items()
                for dtype, dims in [expected[name]] if t.dtype != dtype or t.dim() != dims]
    if problems:
        return problems
    if graph.edge_index.shape[0] != 2:
        problems.append(f"edge_index has shape {tuple(graph.edge_index.shape)}, expected [2, E]")
    problems += [f"{name} has {getattr(graph, name).shape[0]} rows, x has {n}: one per node"
                 for name in ("y", *MASKS) if getattr(graph, name).shape[0] != n]
    if graph.edge_weight is not None and graph.edge_weight.shape[0] != graph.edge_index.shape[1]:
        problems.append(f"edge_weight has {graph.edge_weight.shape[0]} entries, edge_index {graph.edge_index.shape[1]} "
                        "edges: one per edge")
    return problems
