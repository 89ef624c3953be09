"""The visual RL prompt builder (``data/build_vqa_rl.py``): each record is a visual QA sample whose
last assistant turn is the hidden answer, on a picture that is neither the VQA set's nor the
preference pairs' of the same index (another seed: held-out prompts are new), and its shards pass
the ``chat_media_prompts`` launch check under the VLM GRPO recipe's model."""

from __future__ import annotations

import json
import random
from pathlib import Path

from veomni.config.load import load_config
from veomni.contract import build_config
from veomni.data.builders import load_script
from veomni.data.chat.media_prompts import check_media_prompts_data
from veomni.data.sources import ReadStats, iter_tar_samples, resolve_files

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "rl" / "tiny_vqa_grpo.yaml"


def test_prompts_hide_the_answer_on_new_pictures_and_pass_the_launch_check(tmp_path: Path) -> None:
    builder = load_script(REPO / "data" / "build_vqa_rl.py")
    builder.build(tmp_path / "rl" / "train", tmp_path / "rl" / "eval", 1234, 6, 4)
    _, files = resolve_files(str(tmp_path / "rl" / "train"), "webdataset")
    records = list(iter_tar_samples(files, max_bad_fraction=0.0, stats=ReadStats()))
    others = [random.Random("1234:train"), random.Random("1234:preference:train")]  # the SFT set's, the pairs'
    pictures = [[builder.VQA.sample_record(index, rng)[0]["png"] for index in range(4, 10)] for rng in others]
    assert len(records) == 6
    for i, record in enumerate(records):
        obj = json.loads(record["json"])
        assert [m["role"] for m in obj["messages"]] == ["user", "assistant"] and obj["question_type"]
        assert obj["messages"][0]["content"].startswith("<image>\n") and obj["messages"][1]["content"]
        assert all(record["png"] != seen[i] for seen in pictures)
    cfg = load_config(RECIPE)
    cfg.data.train_path, cfg.data.eval_path = str(tmp_path / "rl" / "train"), str(tmp_path / "rl" / "eval")
    assert check_media_prompts_data(cfg.data, build_config(cfg.model.arch, cfg.model.options)) == []
