"""Data at scale: one pass of I/O per epoch whatever the layout, exact resume by seeking (also at
another layout), weighted mixtures, and bad sources refused at launch."""

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from tests.data.test_data_loader import config, expected_chunks, make_docs, samples_of, take, write_shards
from veomni.config.schema import SourceConfig
from veomni.data.build_loader import build_dataloader
from veomni.data.mixture import check_sources, next_source
from veomni.data.text.packed import SOURCE_COUNTS, load_tokenizer, merge_loader_states

TOKENIZER = Path(__file__).resolve().parents[2] / "data" / "tokenizers" / "stdlib-bpe-8k"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(TOKENIZER))


@pytest.fixture(scope="module")
def docs():
    return make_docs(120, seed=5)


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"txt": t}) + "\n" for t in texts))
    return path


def epoch_of(tokenizer, cfg, rank, dp_size):
    """One consumer's samples of one eval pass and the bytes it read."""
    loader = build_dataloader(cfg, "eval", tokenizer, rank, dp_size, 0)
    samples = [s for b in loader for s in samples_of(b)]
    return samples, loader.dataset.bytes_read


@pytest.mark.parametrize("layout", ["tar-many-shards", "tar-few-shards", "jsonl-one-file"])
def test_one_pass_of_io_per_epoch_at_1_2_4_ranks(tokenizer, docs, tmp_path, layout):
    if layout == "jsonl-one-file":
        path = write_jsonl(tmp_path / "d" / "all.jsonl", docs)
        shard = path.stat().st_size
    else:
        path = write_shards(tmp_path / "d", docs, per_shard=10 if layout == "tar-many-shards" else 60)
        shard = max(f.stat().st_size for f in path.glob("*.tar"))
    total = sum(f.stat().st_size for f in Path(path if path.is_dir() else path.parent).iterdir())
    everything = sorted(expected_chunks(tokenizer, docs))
    read = {}
    for dp_size in (1, 2, 4):
        got, read[dp_size] = [], 0
        for rank in range(dp_size):
            samples, nbytes = epoch_of(tokenizer, config(path), rank, dp_size)
            got += samples
            read[dp_size] += nbytes
        assert sorted(got) == everything, f"dp={dp_size}: not every sample exactly once"
    assert read[1] == total
    for dp_size in (2, 4):  # each byte once; splitting a shard costs at most a record or a header scan
        assert abs(read[dp_size] - read[1]) <= shard, (layout, read)


def test_train_epochs_shuffle_samples_across_shards(tokenizer, docs, tmp_path):
    path = write_shards(tmp_path / "d", docs, per_shard=30)
    loader = build_dataloader(config(path, shuffle_window=64), "train", tokenizer, 0, 1, seed=1)
    per_epoch = len(expected_chunks(tokenizer, docs))
    samples, it = [], iter(loader)
    while len(samples) < 2 * per_epoch:
        samples.extend(samples_of(next(it)))
    first, second = samples[:per_epoch], samples[per_epoch:2 * per_epoch]
    assert sorted(first) == sorted(second) == sorted(expected_chunks(tokenizer, docs))
    assert first != second
    starts = [re.match(r"doc (\d+):", tokenizer.decode(s)) for s in first[:40]]
    order = [int(m.group(1)) for m in starts if m]
    assert len(order) > 10 and order != sorted(order)  # not in shard order: shuffled within the window


def test_resume_reads_one_window_wherever_it_stood(tokenizer, docs, tmp_path):
    """Resume cost does not grow with the position in the epoch: bytes read to yield the first batch
    after a resume at 10% and at 90% of an epoch are within one window of each other."""
    path = write_shards(tmp_path / "d", docs, per_shard=12)
    cfg = config(path, shuffle_window=8)
    batches = len(list(build_dataloader(cfg, "eval", tokenizer, 0, 1, 0)))
    cost = {}
    for fraction in (0.1, 0.9):
        loader = build_dataloader(cfg, "train", tokenizer, 0, 1, 0)
        take(loader, int(batches * fraction))
        resumed = build_dataloader(cfg, "train", tokenizer, 0, 1, 0)
        resumed.load_state_dict(loader.state_dict())
        take(resumed, 1)
        cost[fraction] = resumed.dataset.bytes_read
    whole = sum(f.stat().st_size for f in path.glob("*.tar"))
    assert cost[0.9] < whole / 3 and cost[0.1] < whole / 3, cost
    assert abs(cost[0.9] - cost[0.1]) < whole / 4, cost


def drawn_refs(loader, limit: int | None = None) -> list[tuple]:
    """Where each sample lives (the loader unpacked to single samples): ``limit`` of them, or the
    rest of epoch 0."""
    loader.dataset.unpacked = True
    it, refs = iter(loader), []
    while len(refs) != limit and loader.dataset._pos.sources[0].epoch == 0:
        ref = next(it).ref
        refs.append((ref.file, ref.offset, ref.item_offset))
    return refs


@pytest.mark.parametrize("old, new", [(2, 3), (3, 2), (4, 1)])
def test_resume_at_another_layout_sees_every_sample_once(tokenizer, docs, tmp_path, old, new):
    path = write_shards(tmp_path / "d", docs, per_shard=20)
    cfg = config(path, shuffle_window=8)
    everything = drawn_refs(build_dataloader(cfg, "eval", tokenizer, 0, 1, 0))
    consumed, states = [], []
    for rank in range(old):  # ranks stop at different depths of the epoch, some inside a window
        loader = build_dataloader(cfg, "train", tokenizer, rank, old, 0)
        consumed += drawn_refs(loader, limit=5 + 7 * rank)
        states.append(loader.state_dict())
    merged = merge_loader_states(states)
    rest = []
    for rank in range(new):
        loader = build_dataloader(cfg, "train", tokenizer, rank, new, 0)
        loader.load_state_dict(merged)
        rest += drawn_refs(loader)
    assert len(everything) > 100
    assert Counter(consumed + rest) == Counter(everything)  # nothing twice, nothing skipped


def test_mixture_realises_its_weights_and_a_change_at_resume_acts_next_step(tokenizer, tmp_path):
    a = write_jsonl(tmp_path / "a" / "a.jsonl", [f"alpha {i} " + "x " * (i % 7) for i in range(400)])
    b = write_jsonl(tmp_path / "b" / "b.jsonl", [f"beta {i} " + "y " * (i % 5) for i in range(400)])
    sources = [SourceConfig(path=str(a), weight=0.7, name="a"), SourceConfig(path=str(b), weight=0.3, name="b")]
    cfg = config(a, train_path="", sources=sources, max_seq_len=64, tokens_per_micro_batch=64)
    loader = build_dataloader(cfg, "train", tokenizer, 0, 1, 0)
    counts, it = Counter(), iter(loader)
    while sum(counts.values()) < 1000:
        counts.update(next(it)[SOURCE_COUNTS])
    share = counts["a"] / sum(counts.values())
    assert abs(share - 0.7) < 0.02, counts

    state = loader.state_dict()
    sources[0].weight, sources[1].weight = 0.2, 0.8
    resumed = build_dataloader(cfg, "train", tokenizer, 0, 1, 0)
    resumed.load_state_dict(state)
    after, batches = Counter(), take(resumed, 60)
    for batch in batches:
        after.update(batch[SOURCE_COUNTS])
    assert abs(after["b"] / sum(after.values()) - 0.8) < 0.02, after
    fresh = take(build_dataloader(cfg, "train", tokenizer, 0, 1, 0), 1)[0]  # starts both sources over
    assert batches[0]["input_ids"].tolist() != fresh["input_ids"].tolist()  # the resumed one kept its positions


def test_mixture_resumes_exactly_with_three_sources(tokenizer, tmp_path):
    folders = []
    for name, n in (("code", 150), ("prose", 90), ("notes", 60)):
        docs = make_docs(n, seed=hash(name) % 100)
        folders.append(write_shards(tmp_path / name, [f"{name}: {d}" for d in docs], per_shard=25))
    sources = [SourceConfig(path=str(f), weight=w) for f, w in zip(folders, (0.5, 0.3, 0.2))]
    cfg = config(folders[0], train_path="", sources=sources, shuffle_window=16)
    reference = take(build_dataloader(cfg, "train", tokenizer, 1, 2, 4), 40)
    for k in (1, 17, 39):
        loader = build_dataloader(cfg, "train", tokenizer, 1, 2, 4)
        head = take(loader, k)
        resumed = build_dataloader(cfg, "train", tokenizer, 1, 2, 4)
        resumed.load_state_dict(loader.state_dict())
        for got, want in zip(head + take(resumed, 40 - k), reference, strict=True):
            assert got["input_ids"].tolist() == want["input_ids"].tolist()
            assert got[SOURCE_COUNTS] == want[SOURCE_COUNTS]


def test_next_source_is_within_one_sample_of_the_weights():
    weights, counts = [0.5, 0.25, 0.25, 0.0], [0, 0, 0, 0]
    for drawn in range(1, 501):
        counts[next_source(weights, counts)] += 1
        assert all(abs(c - w * drawn) <= 1 for c, w in zip(counts, weights))
    assert counts[3] == 0


def test_bad_sources_fail_at_launch_naming_the_source(tokenizer, tmp_path):
    good = write_jsonl(tmp_path / "good" / "g.jsonl", ["some text"] * 3)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "e.jsonl").write_text("\n\n")

    def problems(*sources):
        return check_sources(config(good, train_path="", sources=list(sources)))

    missing = problems(SourceConfig(path=str(good)), SourceConfig(path=str(tmp_path / "nowhere"), name="web"))
    assert len(missing) == 1 and "'web'" in missing[0] and "does not exist" in missing[0]
    negative = problems(SourceConfig(path=str(good), name="g", weight=-1.0))
    assert "'g'" in negative[0] and "negative" in negative[0]
    zero = problems(SourceConfig(path=str(good), name="g", weight=0.0))
    assert "sum to zero" in zero[0]
    no_record = problems(SourceConfig(path=str(good)), SourceConfig(path=str(empty), name="blank"))
    assert len(no_record) == 1 and "'blank'" in no_record[0] and "no record" in no_record[0]
    twice = problems(SourceConfig(path=str(good), name="x"), SourceConfig(path=str(good), name="x"))
    assert "used twice" in twice[0]


def test_sources_in_a_recipe_resolve_paths_and_refuse_unknown_keys(tmp_path):
    from veomni.config.load import load_config
    from veomni.config.types import ConfigError

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {arch: llm}\ndata:\n  sources:\n    - {path: corpus/a, weight: 0.7}\n"
                      "    - {path: corpus/b, weight: 0.3, name: bee, prepare: build.py}\n")
    cfg = load_config(recipe)
    assert [s.path for s in cfg.data.sources] == [str(tmp_path / "corpus" / "a"), str(tmp_path / "corpus" / "b")]
    assert cfg.data.sources[1].prepare == str(tmp_path / "build.py") and cfg.data.sources[1].name == "bee"
    assert load_config(recipe, ["--data.sources", "[{path: /x, weight: 2}]"]).data.sources[0].weight == 2.0
    recipe.write_text("model: {arch: llm}\ndata:\n  sources:\n    - {path: a, wieght: 0.7}\n")
    with pytest.raises(ConfigError, match=r"r.yaml:3: unknown key 'data.sources\[0\].wieght'.*weight"):
        load_config(recipe)


def test_each_source_is_built_by_its_own_prepare_at_launch(tmp_path, capfd):
    """Through the launcher: a missing source is built by its builder (held-out split beside it),
    a source that does not exist and has none is named, before any worker starts."""
    from veomni.launch import main

    builder = tmp_path / "build.py"
    builder.write_text(
        "import argparse, json, pathlib\n"
        "p = argparse.ArgumentParser(); p.add_argument('--train-out'); p.add_argument('--eval-out')\n"
        "a = p.parse_args()\n"
        "for out in (a.train_out, a.eval_out):\n"
        "    pathlib.Path(out).mkdir(parents=True)\n"
        "    (pathlib.Path(out) / 'd.jsonl').write_text(json.dumps({'txt': 'def f(): pass'}) + '\\n')\n")
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "quickstart" / "tiny_llm.yaml"
    sources = f"[{{path: {tmp_path}/built/train, prepare: {builder}}}, {{path: {tmp_path}/missing, name: gone}}]"
    common = ["--data.train_path", "''", "--data.prepare", "null", "--data.eval_path", "null"]
    status = main([str(recipe), *common, "--data.sources", sources])
    output = capfd.readouterr().err
    assert status == 2 and "data.sources[1] ('gone'): path does not exist" in output
    assert (tmp_path / "built" / "train" / "d.jsonl").is_file() and (tmp_path / "built" / "eval").is_dir()
    status = main([str(recipe), *common, "--data.sources", f"[{{path: {tmp_path}/built/train}}]"])
    assert status == 0, capfd.readouterr().err
