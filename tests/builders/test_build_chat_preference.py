"""The bundled preference pairs: valid chat_preference records whose two replies hold the same,
correct digits and differ only in the form (chosen comma-separated, rejected the SFT set's spaces)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.chat_utils import REPO
from veomni.data.builders import load_script
from veomni.data.sources import tar_samples


def test_pairs_prefer_commas_over_the_sft_form(tmp_path: Path) -> None:
    builder = load_script(REPO / "data" / "build_chat_preference.py")
    builder.main(["--train-out", str(tmp_path / "train"), "--eval-out", str(tmp_path / "eval"),
                  "--train-samples", "40", "--eval-samples", "10"])
    records = [json.loads(sample["json"]) for sample in tar_samples(next((tmp_path / "eval").glob("*.tar")))]
    assert len(records) == 10 and (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    for record in records:
        task = "sort" if record["prompt"][0]["content"].startswith("Sort") else "reverse"
        digits = record["prompt"][-1]["content"].split()
        answer = sorted(digits) if task == "sort" else digits[::-1]
        assert record["rejected"][0]["content"] == " ".join(answer)
        assert record["chosen"][0]["content"] == ", ".join(answer)
