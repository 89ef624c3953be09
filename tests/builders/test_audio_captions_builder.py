"""The audio-caption builder: deterministic, disjoint splits, complete manifests, cache hit, and
captions that an independent analysis of the audio agrees with (pitch band, sweep direction,
number of sound events)."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np

from models.audio.processing import decode_wav
from veomni.data.builders import load_script

BUILDER = Path(__file__).resolve().parents[2] / "data" / "build_audio_captions.py"
PITCH_BANDS = {"low": (150, 300), "middle": (400, 700), "high": (1000, 2000)}
COUNTS = {"One": 1, "Two": 2, "Three": 3, "Four": 4, "once": 1, "twice": 2, "three times": 3}


def build(root: Path, seed: int = 1234) -> None:
    """In-process build (the command line is exercised once, for the cache hit)."""
    load_script(BUILDER).build(root / "train", root / "eval", seed, train_samples=48, eval_samples=16)


def run_builder_cli(train: Path, eval_: Path) -> str:
    result = subprocess.run(
        [
            sys.executable,
            str(BUILDER),
            "--train-out",
            str(train),
            "--eval-out",
            str(eval_),
            "--train-samples",
            "48",
            "--eval-samples",
            "16",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return result.stdout


def read_split(folder: Path) -> dict[str, dict]:
    """key -> {"wav": bytes, "json": dict} from every shard of a split."""
    samples: dict[str, dict] = {}
    for shard in sorted(folder.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                key, suffix = member.name.split(".", 1)
                data = tar.extractfile(member).read()
                samples.setdefault(key, {})[suffix] = json.loads(data) if suffix == "json" else data
    return samples


def _dominant_hz(wave: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(wave.shape[0])))
    return float(np.fft.rfftfreq(wave.shape[0], 1 / rate)[spectrum.argmax()])


def _events(wave: np.ndarray, rate: int) -> list[tuple[int, int]]:
    """(start, end) sample ranges where the 10 ms RMS is above the noise floor."""
    hop = rate // 100
    rms = np.sqrt(np.mean(wave[: wave.shape[0] // hop * hop].reshape(-1, hop) ** 2, axis=1))
    active = np.concatenate([[False], rms > 0.05, [False]])
    edges = np.flatnonzero(np.diff(active.astype(int)))
    return [(a * hop, b * hop) for a, b in zip(edges[::2], edges[1::2])]


def check_caption(sample: dict) -> None:
    wave, rate = decode_wav(sample["wav"])
    meta = sample["json"]
    caption = meta["messages"][1]["content"]
    assert meta["messages"][0] == {"role": "user", "content": "<audio>\nDescribe the sound."}
    assert rate == 16000 and 0.2 < wave.shape[0] / rate < 2.0
    events = _events(wave, rate)
    kind, words = meta["question_type"], caption.rstrip(".").split()
    if kind == "tone":
        assert len(events) == 1, caption
        start, end = events[0]
        low, high = PITCH_BANDS[words[2]]
        assert low - 20 <= _dominant_hz(wave[start:end], rate) <= high + 20, caption
        assert (end - start) / rate < 0.5 if words[1] == "short" else (end - start) / rate > 0.7, caption
    elif kind == "chirp":
        start, end = events[0]
        third = (end - start) // 3
        first, last = (
            _dominant_hz(wave[start : start + third], rate),
            _dominant_hz(wave[end - third : end], rate),
        )
        assert (first < last) == (words[1] == "rising"), caption
    elif kind == "noise":
        assert len(events) == COUNTS[caption[len("Noise ") : -1]], caption
    else:
        assert len(events) == COUNTS[words[0]], caption
        if kind == "beeps":
            low, high = PITCH_BANDS[words[1]]
            assert all(low - 40 <= _dominant_hz(wave[a:b], rate) <= high + 40 for a, b in events), caption


def test_builder_is_deterministic_with_disjoint_truthful_splits(tmp_path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    build(first)
    build(second)
    splits = {}
    for split in ("train", "eval"):
        manifest = json.loads((first / split / "manifest.json").read_text())
        samples = read_split(first / split)
        assert samples == read_split(second / split)  # same seed, same bytes per sample
        assert len(samples) == manifest["samples"] == (48 if split == "train" else 16)
        kinds = {kind: sum(c.values()) for kind, c in manifest["captions"].items()}
        assert sum(kinds.values()) == len(samples)
        splits[split] = samples
    assert not set(splits["train"]) & set(splits["eval"])
    assert not {s["wav"] for s in splits["train"].values()} & {s["wav"] for s in splits["eval"].values()}
    eval_manifest = json.loads((first / "eval" / "manifest.json").read_text())
    assert set(eval_manifest["majority_baseline"]) == {"tone", "chirp", "noise", "beeps", "overall"}
    captions = set(load_script(BUILDER).possible_captions())
    for sample in [*splits["train"].values(), *splits["eval"].values()]:
        check_caption(sample)
        assert sample["json"]["messages"][1]["content"] in captions
    assert sorted(p.name for p in first.iterdir() if p.name != ".build.lock") == ["eval", "train"]
    assert run_builder_cli(first / "train", first / "eval").startswith("cached")

    build(tmp_path / "c", seed=7)
    other = read_split(tmp_path / "c" / "eval")
    assert other.keys() == splits["eval"].keys() and all(
        other[k]["wav"] != splits["eval"][k]["wav"] for k in other
    )
