"""The GRPO recipe's inputs: ``data/build_chat_sft_model.py --step N`` picks the complete
checkpoint of step N (not the newest, and none when that step is missing or unfinished), and
``data/build_chat_rl.py`` writes 6-digit lists whose hidden answer is the reversed or sorted list."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

from veomni.data.builders import load_script

DATA = Path(__file__).resolve().parents[2] / "data"


def _checkpoint(run: Path, step: int, complete: bool) -> Path:
    folder = run / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    if complete:
        (folder / "complete.json").write_text("{}")
    return folder


def test_step_picks_that_checkpoint_and_only_a_complete_one(tmp_path):
    builder = load_script(DATA / "build_chat_sft_model.py")
    half = _checkpoint(tmp_path, 150, complete=True)
    last = _checkpoint(tmp_path, 300, complete=True)
    _checkpoint(tmp_path, 450, complete=False)
    assert builder.chosen_checkpoint(tmp_path, None) == last
    assert builder.chosen_checkpoint(tmp_path, 150) == half
    assert builder.chosen_checkpoint(tmp_path, 450) is None
    assert builder.chosen_checkpoint(tmp_path, 600) is None


def test_rl_prompts_are_six_digit_lists_with_checkable_answers(tmp_path):
    builder = load_script(DATA / "build_chat_rl.py")
    builder.build(tmp_path / "train", tmp_path / "eval", seed=7, train_samples=40, eval_samples=10)
    seen = 0
    for shard in sorted((tmp_path / "train").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                if member.name.endswith(".json"):
                    messages = json.loads(tar.extractfile(member).read())["messages"]
                    digits, answer = messages[-2]["content"].split(), messages[-1]["content"].split()
                    want = sorted(digits) if messages[0]["content"].startswith("Sort") else digits[::-1]
                    assert len(digits) == 6 and answer == want
                    seen += 1
    assert seen == 40
