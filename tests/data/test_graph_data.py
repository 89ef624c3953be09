"""Graph data: the folder format and its checks, the partitioner, partition views, the ``graph``
dataset kind's micro-batch stream and resume, and the builders (~20 s)."""

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.graph_utils import write_raw
from veomni.config.schema import DataConfig
from veomni.data.build_loader import build_dataloader
from veomni.data.builders import load_script
from veomni.data.graph.dataset import GraphDataset, check_graph_data
from veomni.data.graph.format import (
    MANIFEST,
    TENSORS,
    GraphData,
    GraphFormatError,
    check_graph,
    load_graph,
    save_graph,
)
from veomni.data.graph.partition import chunk_nodes, edge_cut, metis_binding, partition_nodes
from veomni.data.graph.views import edge_weights, partition_views
from veomni.data.kinds import MERGED_KEY, DatasetRequest
from veomni.tasks import IGNORE_INDEX

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

BUILDER = Path(__file__).resolve().parents[2] / "data" / "build_graph.py"


@pytest.fixture(scope="module")
def builder():
    return load_script(BUILDER)


@pytest.fixture(scope="module")
def sbm(builder) -> GraphData:
    return builder.sbm_graph(n=3000, d=12.0, c=6, f=16, h=0.85, s=0.3, seed=3)


@dataclass
class GraphModel:
    in_features: int
    num_classes: int
    neighbour_norm: str = "gcn"


def small_graph(**changes) -> GraphData:
    n = 6
    fields = dict(x=torch.randn(n, 3), y=torch.tensor([0, 1, 0, 1, -1, 1]),
                  edge_index=torch.tensor([[0, 1, 1, 2, 2, 3, 4, 5], [1, 0, 2, 1, 3, 2, 5, 4]]),
                  train_mask=torch.tensor([1, 1, 0, 0, 0, 0], dtype=torch.bool),
                  val_mask=torch.tensor([0, 0, 1, 0, 0, 0], dtype=torch.bool),
                  test_mask=torch.tensor([0, 0, 0, 1, 0, 1], dtype=torch.bool), num_classes=2, name="small")
    return GraphData(**{**fields, **changes})


# ----- format --------------------------------------------------------------------------------------
def test_round_trip_keeps_tensors_and_describes_them(tmp_path):
    graph = small_graph(class_names=["a", "b"])
    save_graph(tmp_path / "g", graph, format_version=7)
    loaded = load_graph(tmp_path / "g")
    for name, tensor in graph.tensors().items():
        assert torch.equal(getattr(loaded, name), tensor), name
    manifest = loaded.manifest
    assert (manifest["format"], manifest["num_nodes"], manifest["num_edges"], manifest["num_features"],
            manifest["num_classes"], manifest["class_names"], manifest["format_version"]) == (
        "veomni-graph/1", 6, 8, 3, 2, ["a", "b"], 7)
    assert check_graph(loaded) == []
    save_graph(tmp_path / "g", small_graph(num_classes=3))  # replaces a graph folder
    assert load_graph(tmp_path / "g").num_classes == 3
    (tmp_path / "g" / "notes.txt").write_text("mine")
    with pytest.raises(GraphFormatError, match="not a graph's"):
        save_graph(tmp_path / "g", graph)


@pytest.mark.parametrize("changes, expected", [
    ({"edge_index": torch.tensor([[0, 1, 9], [1, 7, 2]])}, r"2 edges point outside the 6 nodes \(largest id 9"),
    ({"val_mask": torch.tensor([1, 0, 1, 0, 0, 0], dtype=torch.bool)}, "train_mask and val_mask overlap on 1 nodes"),
    ({"x": torch.randn(6, 3).index_put_((torch.tensor([1, 4]), torch.tensor([0, 2])), torch.tensor(float("nan")))},
     "2 rows of x hold NaN or inf"),
    ({"y": torch.tensor([0, 1, 0, 5, -1, 1])}, r"1 labels lie outside \[0, 2\)"),
    ({"y": torch.tensor([0, 1, 0, -1, -1, 1])}, "1 nodes of test_mask have no label"),
    ({"y": torch.tensor([0, 1])}, "y has 2 rows, x has 6"),
])
def test_bad_graph_is_refused_with_what_and_where(tmp_path, changes, expected):
    graph = small_graph(**changes)
    with pytest.raises(GraphFormatError, match=expected):
        save_graph(tmp_path / "g", graph)
    write_raw(tmp_path / "raw", graph)
    problems = check_graph_data(DataConfig(train_path=str(tmp_path / "raw")), GraphModel(3, 2))
    assert len(problems) == 1 and str(tmp_path / "raw") in problems[0]
    assert __import__("re").search(expected, problems[0]), problems


def test_corrupt_file_and_hand_edited_manifest_are_caught(tmp_path):
    folder = save_graph(tmp_path / "g", small_graph())
    data = bytearray((folder / TENSORS).read_bytes())
    data[-3] ^= 0xFF
    (folder / TENSORS).write_bytes(bytes(data))
    with pytest.raises(GraphFormatError, match=f"{folder / TENSORS}: sha256 differs .* corrupt"):
        load_graph(folder)
    folder = save_graph(tmp_path / "h", small_graph())
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["num_edges"] = 4
    (folder / MANIFEST).write_text(json.dumps(manifest))
    assert any("manifest says num_edges=4, the tensors give 8" in p for p in check_graph(load_graph(folder)))
    (folder / MANIFEST).unlink()
    with pytest.raises(GraphFormatError, match="manifest.json not found"):
        load_graph(folder)


# ----- partitioner ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["bfs", "index"])
@pytest.mark.parametrize("parts", [2, 3, 4])
def test_partitions_are_balanced(sbm, method, parts):
    part = partition_nodes(sbm.edge_index, sbm.num_nodes, parts, method, seed=0)
    sizes = torch.bincount(part, minlength=parts)
    assert sizes.numel() == parts and int(sizes.max() - sizes.min()) <= 1
    chunk = chunk_nodes(sbm.edge_index, part, parts, 3, method, seed=0)
    for p in range(parts):
        chunk_sizes = torch.bincount(chunk[part == p], minlength=3)
        assert chunk_sizes.numel() == 3 and int(chunk_sizes.max() - chunk_sizes.min()) <= 1


def test_bfs_keeps_neighbours_together(sbm):
    """On a community graph the locality-aware partitioner cuts far fewer edges than a random
    split (random: 1 - 1/parts of the edges)."""
    for parts in (2, 4):
        bfs = edge_cut(sbm.edge_index, partition_nodes(sbm.edge_index, sbm.num_nodes, parts, "bfs", seed=1))
        random_cut = edge_cut(sbm.edge_index, torch.randint(0, parts, (sbm.num_nodes,)))
        assert bfs < 0.6 * random_cut, (parts, bfs, random_cut)
    seeded = [partition_nodes(sbm.edge_index, sbm.num_nodes, 3, "bfs", seed=5) for _ in range(2)]
    assert torch.equal(*seeded)


def test_isolated_nodes_and_small_components_are_placed(sbm):
    edges = torch.tensor([[0, 1, 3, 4, 4, 5], [1, 0, 4, 3, 5, 4]])  # two small components, nodes 2, 6..9 isolated
    part = partition_nodes(edges, 10, 3, "bfs", seed=0)
    assert sorted(torch.bincount(part).tolist()) == [3, 3, 4]


def test_metis_without_a_binding_says_what_to_install(sbm):
    if metis_binding() is not None:
        pytest.skip("a METIS binding is installed here")
    with pytest.raises(ImportError, match="pip install pymetis"):
        partition_nodes(sbm.edge_index, sbm.num_nodes, 2, "metis")
    auto = partition_nodes(sbm.edge_index, sbm.num_nodes, 2, "auto", seed=0)
    assert torch.equal(auto, partition_nodes(sbm.edge_index, sbm.num_nodes, 2, "bfs", seed=0))
    with pytest.raises(ValueError, match="each partition needs a node"):
        partition_nodes(sbm.edge_index, 3, 4, "bfs")


# ----- views -----------------------------------------------------------------------------------------
def test_views_cover_every_edge_once_and_exchanges_agree(builder):
    graph = builder.sbm_graph(n=200, d=6.0, c=3, f=4, h=0.7, s=0.5, seed=0)
    parts, chunks = 2, 3
    edges, weights = edge_weights(graph.edge_index, graph.num_nodes, "gcn")
    part = partition_nodes(graph.edge_index, graph.num_nodes, parts, "bfs", seed=0)
    chunk = chunk_nodes(graph.edge_index, part, parts, chunks, "bfs", seed=0)
    ids = {"id": torch.arange(graph.num_nodes)}
    views = [partition_views(edges, weights, ids, part, parts, p, chunk, chunks) for p in range(parts)]
    for c in [*range(chunks), "whole"]:
        pick = [v[1] if c == "whole" else v[0][c] for v in views]
        for p in range(parts):
            for q in range(parts):
                assert int(pick[p]["send_counts"][q]) == int(pick[q]["recv_counts"][p]), (c, p, q)
    for p in range(parts):
        whole = views[p][1]
        row_id = torch.full((int(whole["history_rows"]),), -1)
        row_id[whole["node_rows"]] = whole["id"]
        senders = [views[q][1] for q in range(parts) if q != p]  # what the others send p, in owner order
        sent = [s["id"][s["send_index"]].split(s["send_counts"].tolist())[p] for s in senders]
        row_id[whole["halo_rows"]] = torch.cat(sent) if sent else torch.empty(0, dtype=torch.long)
        assert (row_id >= 0).all()
        seen = []
        for view in views[p][0]:
            n = view["id"].numel()
            source_id = torch.cat([view["id"], row_id[view["halo_rows"]]])
            fresh, stale = view["edge_index"], view["stale_edge_index"]
            seen.append(torch.stack([source_id[fresh[0]], view["id"][fresh[1]]]))
            seen.append(torch.stack([row_id[stale[0]], view["id"][stale[1]]]))
            assert bool((fresh[1] < n).all()) and bool((stale[1] < n).all())
        got = torch.cat(seen, dim=1)
        expected = edges[:, part[edges[1]] == p]
        key = lambda e: torch.sort(e[0] * graph.num_nodes + e[1]).values  # noqa: E731
        assert torch.equal(key(got), key(expected)), p  # every edge into p exactly once


# ----- the dataset kind -------------------------------------------------------------------------------
def data_config(folder: Path, **changes) -> DataConfig:
    values = dict(kind="graph", train_path=str(folder), eval_path=str(folder), graph_partitioner="bfs",
                  graph_warmup_epochs=1, graph_refresh_every=4)
    return DataConfig(**{**values, **changes})


def dataset(folder: Path, cfg: DataConfig, graph: GraphData, rank=0, split="train", micro_batches=3, **model):
    model_config = GraphModel(graph.num_features, graph.num_classes, **model)
    return GraphDataset(DatasetRequest(cfg, str(folder), split, None, rank, 2, 11, model_config, micro_batches))


def chunk_order(ds: GraphDataset, batches: list[dict]) -> list:
    return [next(("whole" if b is ds.whole else "empty" if b["x"].shape[0] == 0 else i)
                 for i, v in enumerate([*ds.chunk_views, ds.whole, b]) if v is b) for b in batches]


def take(iterator, k):
    return [next(iterator) for _ in range(k)]


def test_train_stream_exact_epochs_and_shuffled_chunks(tmp_path, sbm):
    folder = save_graph(tmp_path / "g", sbm)
    cfg = data_config(folder)
    ds = [dataset(folder, cfg, sbm, rank=r) for r in range(2)]
    orders = [chunk_order(d, take(iter(d), 3 * 9)) for d in ds]
    assert orders[0] == orders[1]  # every rank runs the same chunk at the same time
    epochs = [orders[0][3 * e:3 * e + 3] for e in range(9)]
    for e in (0, 4, 8):  # warm-up, then every graph_refresh_every-th
        assert epochs[e] == ["whole", "empty", "empty"], e
    chunked = [epochs[e] for e in (1, 2, 3, 5, 6, 7)]
    assert all(sorted(order) == [0, 1, 2] for order in chunked) and len({tuple(o) for o in chunked}) > 1
    fixed = dataset(folder, data_config(folder, graph_chunk_order="fixed"), sbm)
    assert chunk_order(fixed, take(iter(fixed), 6))[3:] == [0, 1, 2]
    one = dataset(folder, cfg, sbm, micro_batches=1)
    assert all(b is one.whole for b in take(iter(one), 4))
    labelled = [int((d.whole["labels"] != IGNORE_INDEX).sum()) for d in ds]
    assert sum(labelled) == int(sbm.train_mask.sum())  # the training nodes, each in one partition


def test_eval_stream_is_one_whole_view_with_val_and_test_labels(tmp_path, sbm):
    folder = save_graph(tmp_path / "g", sbm)
    views = [list(dataset(folder, data_config(folder), sbm, rank=r, split="eval")) for r in range(2)]
    assert [len(v) for v in views] == [1, 1]
    for name, mask in (("labels", sbm.val_mask), ("test_labels", sbm.test_mask)):
        assert sum(int((v[0][name] != IGNORE_INDEX).sum()) for v in views) == int(mask.sum())
    assert sum(v[0]["x"].shape[0] for v in views) == sbm.num_nodes


def test_resume_gives_the_same_next_micro_batches(tmp_path, sbm):
    folder = save_graph(tmp_path / "g", sbm)
    cfg = data_config(folder)
    loader = build_dataloader(cfg, "train", None, 0, 2, 11, GraphModel(16, 6), "graph", micro_batches=3)
    stream = iter(loader)
    take(stream, 7)
    state = loader.state_dict()
    expected = take(stream, 8)
    resumed = build_dataloader(cfg, "train", None, 0, 2, 11, GraphModel(16, 6), "graph", micro_batches=3)
    resumed.load_state_dict(state)
    for a, b in zip(expected, take(iter(resumed), 8)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    merged = GraphDataset.merge_states([state, state])  # another layout restarts at the epoch boundary
    assert merged == {MERGED_KEY: {"epoch": 2}}
    other = dataset(folder, cfg, sbm, micro_batches=2)
    other.start_from(merged[MERGED_KEY])
    assert [tuple(b["x"].shape) for b in take(iter(other), 2)] == [tuple(b["x"].shape)
                                                                  for b in other.epoch_views(2)]


def test_model_and_recipe_mismatches_name_the_keys(tmp_path, sbm):
    folder = save_graph(tmp_path / "g", sbm)
    with pytest.raises(ValueError, match="set model.in_features: 16"):
        GraphDataset(DatasetRequest(data_config(folder), str(folder), "train", None, 0, 1, 0, GraphModel(8, 6)))
    problems = check_graph_data(data_config(folder, num_workers=2), object())
    assert any("GraphModelConfig" in p for p in problems) and any("data.num_workers: 0" in p for p in problems)
    assert check_graph_data(data_config(folder), GraphModel(16, 7)) == [
        f"data.train_path: model.num_classes=7, but the graph {folder} has 6 classes; set model.num_classes: 6"]
    assert "not found" in check_graph_data(data_config(tmp_path / "none"), GraphModel(16, 6))[0]


# ----- builders --------------------------------------------------------------------------------------
def run_builder(*args: str) -> str:
    return subprocess.run([sys.executable, str(BUILDER), *args], capture_output=True, text=True, check=True,
                          timeout=120).stdout


def test_builders_write_checked_graphs_named_by_their_folder(tmp_path, builder):
    out = run_builder("--train-out", str(tmp_path / "stdlib-calls"), "--max-files", "60", "--classes", "5")
    graph = load_graph(tmp_path / "stdlib-calls")
    assert check_graph(graph) == [] and graph.num_classes == 5 and graph.num_edges > 0
    assert "homophily" in out and graph.manifest["format_version"] == builder.FORMAT_VERSION
    assert "cached" in run_builder("--train-out", str(tmp_path / "stdlib-calls"))
    sbm_folder = tmp_path / "sbm-n1500-c3-d6"
    run_builder("--train-out", str(sbm_folder), "--eval-out", str(tmp_path / "copy"))
    graph = load_graph(sbm_folder)
    assert (graph.num_nodes, graph.num_classes, graph.num_features) == (1500, 3, 64)
    assert abs(graph.num_edges / 1500 - 6) < 0.5 and check_graph(graph) == []
    assert builder.homophily(graph) > 0.7
    assert load_graph(tmp_path / "copy").manifest["files"] == graph.manifest["files"]


def test_stdlib_functions_words_and_call_resolution(builder):
    source = (
        "def helper(): pass\n"
        "class Widget:\n"
        "    def draw_thing(self, colour):\n"
        "        'Paint it.'\n"
        "        helper(); self.size(); unique_elsewhere(); get()\n"
        "    def size(self): pass\n"
    )
    collector = builder._Collector("pkg.mod")
    collector.visit(__import__("ast").parse(source))
    helper, draw, size = collector.functions
    assert draw.words == ["draw", "thing", "colour", "paint", "it"]  # no module or class name: they name the label
    other = builder.Function("other", None, "unique_elsewhere", [], [])
    gets = [builder.Function(m, None, "get", [], []) for m in ("a", "b")]  # ambiguous: not resolved
    pairs = builder.resolve_calls([helper, draw, size, other, *gets])
    assert sorted(map(tuple, pairs.T.tolist())) == [(1, 0), (1, 2), (1, 3)]
    assert builder.tokens("getHTTPResponse_code2") == ["get", "http", "response", "code", "2"]
