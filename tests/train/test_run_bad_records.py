"""``data.max_bad_fraction`` acts on the whole run's bad records, summed over the data-parallel ranks
(``veomni/data/feed.py``), not on one rank's: on 2 gloo ranks through the trainer, a corpus whose bad
lines all sit in one rank's file (half of that rank's records; a bad line costs no tokens, so that rank
reads two records for each of the other's and the run's share is a third) trains on under a limit of 40%
and reports the sum of both ranks' counts on every rank, and stops both ranks alike under 25%."""

from __future__ import annotations

import json
import random
import re

import pytest

from harness.gloo_ranks import run_distributed
from tests.trainer_utils import tiny_run_config
from veomni.data.sources import BadDataError
from veomni.train.trainer import Trainer

BAD = 10
"""Bad lines in the corpus: all in its first file, among as many good ones; the second file is all good."""


def _corpus(folder) -> None:
    rng = random.Random(0)
    words = ["def", "return", "self", "import", "class", "value"]

    def doc(i: int) -> str:
        return json.dumps({"text": f"# {i}\n" + " ".join(rng.choice(words) for _ in range(8))})

    folder.mkdir(parents=True)
    (folder / "a.jsonl").write_text("".join(f"{doc(i)}\n" if i % 2 else "[not a document]\n" for i in range(2 * BAD)))
    (folder / "b.jsonl").write_text("".join(f"{doc(i)}\n" for i in range(2 * BAD)))


def _train(rank, world, tmp, limit):
    cfg = tiny_run_config(tmp / "run")
    cfg.data.train_path = str(tmp / "corpus")
    cfg.data.eval_path = None
    cfg.data.shuffle = False
    cfg.data.max_bad_fraction = limit
    cfg.train.max_steps, cfg.train.eval_interval = 12, 0
    cfg.checkpoint.interval, cfg.checkpoint.save_final = 0, False
    trainer = Trainer(cfg)
    try:
        metrics = trainer.train()
    except BadDataError as error:
        return str(error)
    assert not [key for m in metrics for key in m if key.startswith("mix_")], "one source: no mixture to report"
    return [m.get("bad_records") for m in metrics], trainer.train_loader.dataset.read_counts()


@pytest.fixture
def corpus(tmp_path):
    _corpus(tmp_path / "corpus")
    return tmp_path


def test_a_rank_with_more_than_its_share_of_bad_records_does_not_stop_the_run(corpus):
    (reported, own), (other_reported, other) = run_distributed(_train, 2, corpus, 0.4)
    own, other = own[:3], other[:3]  # records, bad, a pass finished
    assert reported == other_reported and reported[-1] == own[1] + other[1]  # the run's count, on every rank
    assert max(own[1] / own[0], other[1] / other[0]) > 0.4  # a rank's own share would have stopped it
    assert 0 < reported[-1] / (own[0] + other[0]) <= 0.4


def test_the_run_stops_every_rank_alike_on_the_runs_share(corpus):
    stopped = run_distributed(_train, 2, corpus, 0.25)
    assert stopped[0] == stopped[1], stopped
    found = re.search(r"(\d+) of (\d+) records were bad \(([\d.]+)% > data.max_bad_fraction 25.0%\), summed over "
                      r"the run's 2 data-parallel rank\(s\); worst file (.*) \((\d+) bad", stopped[0])
    assert found and int(found[1]) >= BAD and float(found[3]) > 25, stopped
    assert found[4].startswith(str(corpus / "corpus")) and int(found[5]) > 0, stopped  # the rank reading a.jsonl


def test_each_batch_counts_the_records_its_bad_ones_are_among(tmp_path):
    """``READ_COUNTS`` of every micro-batch: the records passed on so far and the bad among them, counted
    alike (positions count a window's records from its start, its bad ones as they are passed on)."""
    from tests.trainer_utils import TOKENIZER
    from veomni.data.build_loader import build_dataloader
    from veomni.data.text.packed import READ_COUNTS, load_tokenizer

    _corpus(tmp_path / "corpus")
    cfg = tiny_run_config(tmp_path).data
    cfg.train_path, cfg.shuffle = str(tmp_path / "corpus" / "a.jsonl"), False
    loader = build_dataloader(cfg, "train", load_tokenizer(str(TOKENIZER)), 0, 1, 0)
    loader.dataset.run_counts_bad = True
    batches = iter(loader)
    counts = [next(batches)[READ_COUNTS][:3] for _ in range(4)]
    # the file alternates bad and good lines, a bad one first: of n records passed on, ceil(n / 2) are bad
    assert all(records and bad == (records + 1) // 2 for records, bad, _ in counts), counts
    assert counts[-1][2] == 1 and counts[-1][1] >= BAD, counts  # a pass of the file is done: its bad lines counted
