"""Build the bundled audio-caption set: synthetic sounds whose one-line captions can only be
told from the audio.

Why this set: it is generated offline (no download), small enough for a tiny audio encoder +
LLM to learn on a CPU, and each caption names properties (pitch, length, sweep direction,
count) that the encoder must hear, so held-out caption accuracy far above the majority-class
baseline shows the encoder, the adapter and the splicing work. Four kinds of sound, 16 kHz
mono, 0.3 - 1.6 s, with random silence around them and a faint noise floor:

    tone   one steady sine: low (150-300 Hz) / middle (400-700) / high (1000-2000 Hz),
           short (0.2-0.4 s) / long (0.8-1.2 s)            "A long high tone."
    chirp  a sine sweeping up or down between ~300 and ~1600 Hz   "A rising chirp."
    noise  1-3 bursts of white noise (0.1-0.2 s each)              "Noise twice."
    beeps  2-4 short beeps of one pitch (low / middle / high)       "Three high beeps."

Output: webdataset tar shards in ``--train-out`` and ``--eval-out``; each sample is
``{"__key__", "wav": 16-bit PCM WAV bytes, "json": {"messages": [user "<audio>\\nDescribe the
sound.", assistant caption], "question_type": kind, "attributes": {...}}}`` (the chat format of
docs/data.md). Sample ``i`` is drawn from its own RNG seeded by ``(seed, i)``; eval takes
indices ``0..E-1`` and train the following ones, so the splits never share a clip.
``manifest.json`` is written last and records ``FORMAT_VERSION``, the caption counts per kind
and, for eval, the majority-class baseline. Splits are written to a temporary sibling folder
and renamed into place; a file lock lets concurrent launchers wait for one builder.

    python data/build_audio_captions.py --train-out data/cache/audio_captions/train \\
        --eval-out data/cache/audio_captions/eval
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import webdataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models.audio.processing import encode_wav  # noqa: E402
from veomni.data.builders import (  # noqa: E402
    builder_main,
    majority_baseline,
    publish_split,
    record_baseline,
    staging_folder,
    write_generated_splits,
)

FORMAT_VERSION = 3  # 3: shard_records (records per shard, what a damaged shard lost; publish_split writes it)
SAMPLE_RATE = 16000
TRAIN_SAMPLES = 3000
EVAL_SAMPLES = 400
SAMPLES_PER_SHARD = 1000
PROMPT = "<audio>\nDescribe the sound."
KINDS = ("tone", "chirp", "noise", "beeps")
PITCHES = {"low": (150.0, 300.0), "middle": (400.0, 700.0), "high": (1000.0, 2000.0)}
COUNT_WORDS = {1: "One", 2: "Two", 3: "Three", 4: "Four"}
NOISE_COUNTS = {1: "once", 2: "twice", 3: "three times"}
FADE_S = 0.01


def _sine(rng: np.random.Generator, freq_hz: np.ndarray | float, seconds: float) -> np.ndarray:
    """A sine of (possibly time-varying) frequency with 10 ms fades, random phase and loudness."""
    n = int(seconds * SAMPLE_RATE)
    freq = np.broadcast_to(np.asarray(freq_hz, dtype=np.float64), (n,))
    phase = rng.uniform(0, 2 * np.pi) + 2 * np.pi * np.cumsum(freq) / SAMPLE_RATE
    return _faded(rng.uniform(0.3, 0.8) * np.sin(phase))


def _faded(signal: np.ndarray) -> np.ndarray:
    fade = min(int(FADE_S * SAMPLE_RATE), signal.shape[0] // 2)
    ramp = np.linspace(0.0, 1.0, fade)
    signal[:fade] *= ramp
    signal[signal.shape[0] - fade :] *= ramp[::-1]
    return signal


def _gap(rng: np.random.Generator, low: float, high: float) -> np.ndarray:
    return np.zeros(int(rng.uniform(low, high) * SAMPLE_RATE))


def _events(rng: np.random.Generator, make, count: int) -> np.ndarray:
    """``count`` events separated by 0.1-0.25 s of silence."""
    parts = []
    for i in range(count):
        if i:
            parts.append(_gap(rng, 0.1, 0.25))
        parts.append(make())
    return np.concatenate(parts)


def make_sound(rng: np.random.Generator) -> tuple[np.ndarray, str, str, dict]:
    """``(waveform float [-1, 1], kind, caption, attributes)`` for one random sample."""
    kind = KINDS[rng.integers(len(KINDS))]
    if kind == "tone":
        pitch = list(PITCHES)[rng.integers(3)]
        length = "short" if rng.random() < 0.5 else "long"
        seconds = rng.uniform(0.2, 0.4) if length == "short" else rng.uniform(0.8, 1.2)
        sound = _sine(rng, rng.uniform(*PITCHES[pitch]), seconds)
        caption, attributes = f"A {length} {pitch} tone.", {"pitch": pitch, "length": length}
    elif kind == "chirp":
        direction = "rising" if rng.random() < 0.5 else "falling"
        low, high = rng.uniform(250, 400), rng.uniform(1200, 2000)
        seconds = rng.uniform(0.5, 0.9)
        sweep = np.geomspace(low, high, int(seconds * SAMPLE_RATE))
        sound = _sine(rng, sweep if direction == "rising" else sweep[::-1], seconds)
        caption, attributes = f"A {direction} chirp.", {"direction": direction}
    elif kind == "noise":
        count = int(rng.integers(1, 4))
        amplitude = rng.uniform(0.2, 0.5)
        sound = _events(
            rng,
            lambda: _faded(amplitude * rng.uniform(-1, 1, int(rng.uniform(0.1, 0.2) * SAMPLE_RATE))),
            count,
        )
        caption, attributes = f"Noise {NOISE_COUNTS[count]}.", {"count": count}
    else:
        count = int(rng.integers(2, 5))
        pitch = list(PITCHES)[rng.integers(3)]
        freq = rng.uniform(*PITCHES[pitch])
        sound = _events(rng, lambda: _sine(rng, freq, rng.uniform(0.08, 0.15)), count)
        caption, attributes = f"{COUNT_WORDS[count]} {pitch} beeps.", {"count": count, "pitch": pitch}
    clip = np.concatenate([_gap(rng, 0.03, 0.2), sound, _gap(rng, 0.03, 0.2)])
    clip += rng.uniform(0.002, 0.01) * rng.standard_normal(clip.shape[0])
    return np.clip(clip, -1.0, 1.0), kind, caption, attributes


def possible_captions() -> list[str]:
    """Every caption ``make_sound`` can give (20). Each is at most 8 tokens of the bundled BPE
    tokenizer, so a greedy decode capped at 8 tokens can produce it."""
    tones = [f"A {length} {pitch} tone." for length in ("short", "long") for pitch in PITCHES]
    chirps = ["A rising chirp.", "A falling chirp."]
    noise = [f"Noise {word}." for word in NOISE_COUNTS.values()]
    beeps = [f"{COUNT_WORDS[n]} {pitch} beeps." for n in (2, 3, 4) for pitch in PITCHES]
    return tones + chirps + noise + beeps


def sample_record(index: int, seed: int) -> tuple[dict, str, str, float]:
    """The webdataset record of sample ``index``, its kind, caption and duration in seconds."""
    wave, kind, caption, attributes = make_sound(np.random.default_rng([seed, index]))
    meta = {
        "messages": [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": caption}],
        "question_type": kind,
        "attributes": attributes,
    }
    record = {
        "__key__": f"audio_{index:07d}",
        "wav": encode_wav(wave, SAMPLE_RATE),
        "json": json.dumps(meta).encode(),
    }
    return record, kind, caption, wave.shape[0] / SAMPLE_RATE


def write_split(out: Path, first_index: int, count: int, seed: int) -> dict[str, Counter]:
    """Write samples ``first_index ..`` to a temporary folder, then rename it to ``out``;
    returns the caption counts per kind."""
    tmp = staging_folder(out)
    captions: dict[str, Counter] = {kind: Counter() for kind in KINDS}
    seconds = 0.0
    with webdataset.ShardWriter(str(tmp / "shard-%06d.tar"), maxcount=SAMPLES_PER_SHARD, verbose=0) as writer:
        for index in range(first_index, first_index + count):
            record, kind, caption, duration = sample_record(index, seed)
            writer.write(record)
            captions[kind][caption] += 1
            seconds += duration
    manifest = {
        "samples": count,
        "format_version": FORMAT_VERSION,
        "seed": seed,
        "first_index": first_index,
        "sample_rate": SAMPLE_RATE,
        "seconds": round(seconds, 2),
        "shards": len(list(tmp.glob("*.tar"))),
        "captions": {kind: dict(sorted(c.items())) for kind, c in captions.items()},
    }
    publish_split(tmp, out, manifest)
    return captions


def caption_baseline(
    train: dict[str, Counter], held_out: dict[str, Counter]
) -> dict[str, tuple[str, float]]:
    """The majority baseline per kind (what a model that only tells the kinds apart reaches),
    and "overall": the most common training caption, always given."""
    result = majority_baseline(train, held_out)
    caption = sum(train.values(), Counter()).most_common(1)[0][0]
    all_held_out = sum(held_out.values(), Counter())
    result["overall"] = (caption, all_held_out[caption] / max(1, sum(all_held_out.values())))
    return result


def build(train_out: Path, eval_out: Path, seed: int, train_samples: int, eval_samples: int) -> None:
    train, held_out = write_generated_splits(
        train_out, eval_out, train_samples, eval_samples,
        lambda out, first, count: write_split(out, first, count, seed), unit="clips",
    )
    record_baseline(eval_out, caption_baseline(train, held_out), "caption",
                    "majority-caption baseline on the held-out split (per kind, and overall):")


def main() -> None:
    builder_main(__doc__, FORMAT_VERSION, build, sample_counts=(TRAIN_SAMPLES, EVAL_SAMPLES))


if __name__ == "__main__":
    main()
