"""The stdlib corpus builder: complete splits with manifests, readable shards, cache hit (~2 s)."""

import json
import subprocess
import sys
from pathlib import Path

from veomni.data.sources import ReadStats, iter_texts, resolve_files

BUILDER = Path(__file__).resolve().parents[2] / "data" / "build_stdlib_corpus.py"


def run_builder(train: Path, eval_: Path) -> str:
    result = subprocess.run(
        [sys.executable, str(BUILDER), "--train-out", str(train), "--eval-out", str(eval_)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return result.stdout


def test_builder_writes_complete_splits_and_then_hits_cache(tmp_path):
    train, eval_ = tmp_path / "corpus" / "train", tmp_path / "corpus" / "eval"
    run_builder(train, eval_)
    manifests = {split: json.loads((split / "manifest.json").read_text()) for split in (train, eval_)}
    texts = {}
    for split, manifest in manifests.items():
        fmt, files = resolve_files(str(split))
        stats = ReadStats()
        texts[split] = list(iter_texts(files, fmt, "txt", 0.0, stats))
        assert fmt == "webdataset" and len(files) == manifest["shards"]
        assert sorted(manifest["shard_records"]) == [f.name for f in files]  # publish_split counts each shard
        assert sum(manifest["shard_records"].values()) == manifest["documents"]
        assert len(texts[split]) == manifest["documents"] and stats.bad == 0
        assert sum(len(t.encode()) for t in texts[split]) == manifest["bytes"]
        assert manifest["python"] == sys.version.split()[0]
    n_train, n_eval = (manifests[s]["documents"] for s in (train, eval_))
    assert n_train > 2000 and 0 < n_eval < 0.1 * n_train  # whole files held out, then cut into pieces
    assert not set(texts[train]) & set(texts[eval_])
    leftovers = sorted(p.name for p in (tmp_path / "corpus").iterdir() if p.name != ".build.lock")
    assert leftovers == ["eval", "train"]  # no temp folders left (the lock file may stay)

    assert run_builder(train, eval_).startswith("cached")
