"""The visual preference pair builder (``data/build_vqa_preference.py``): each pair's replies are the same
answer in two forms (chosen capitalised with a full stop, rejected the VQA set's bare word), its
picture is not the VQA set's of the same index (another seed: held-out prompts are new), its shards
pass the ``chat_media_preference`` launch check under the VLM DPO recipe's model, and the VQA eval
reads each pair as the conversation it prefers, keeping the rejected reply."""

from __future__ import annotations

import json
import random
from pathlib import Path

from veomni.config.load import load_config
from veomni.contract import build_config
from veomni.data.builders import load_script
from veomni.data.chat.media_preference import check_media_preference_data
from veomni.data.sources import ReadStats, iter_tar_samples, resolve_files
from veomni.eval.vqa import as_conversation

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "preference" / "tiny_vqa_dpo.yaml"


def test_pairs_prefer_a_form_on_new_pictures_and_pass_the_launch_check(tmp_path: Path) -> None:
    builder = load_script(REPO / "data" / "build_vqa_preference.py")
    builder.build(tmp_path / "pairs" / "train", tmp_path / "pairs" / "eval", 1234, 6, 4)
    _, files = resolve_files(str(tmp_path / "pairs" / "train"), "webdataset")
    pairs = list(iter_tar_samples(files, max_bad_fraction=0.0, stats=ReadStats()))
    rng = random.Random("1234:train")  # the VQA set's train split at the same seed
    pictures = [builder.VQA.sample_record(index, rng)[0]["png"] for index in range(4, 10)]
    assert len(pairs) == 6
    for pair, picture in zip(pairs, pictures):
        obj = json.loads(pair["json"])
        rejected, chosen = obj["rejected"][0]["content"], obj["chosen"][0]["content"]
        assert chosen == rejected.capitalize() + "." and rejected == rejected.lower()
        assert obj["prompt"][0]["content"].startswith("<image>\n") and obj["question_type"]
        assert pair["png"] != picture
        conversation = json.loads(as_conversation(pair, "json")["json"])
        assert conversation["messages"] == [*obj["prompt"], *obj["chosen"]]
        assert conversation["rejected_answer"] == rejected
    cfg = load_config(RECIPE)
    cfg.data.train_path, cfg.data.eval_path = str(tmp_path / "pairs" / "train"), str(tmp_path / "pairs" / "eval")
    assert check_media_preference_data(cfg.data, build_config(cfg.model.arch, cfg.model.options)) == []
