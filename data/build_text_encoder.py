"""Build the tiny frozen text encoder of the video DiT: a random-weight ``UMT5EncoderModel`` (the
family of Wan's text encoder) and a word-level tokenizer over a caption set's vocabulary.

Why random weights: the captions of the bundled clip set are a few dozen words in a fixed grammar,
and nothing may download; a frozen random T5 encoder still gives each word and position its own
stable states, and the DiT's cross-attention learns to read them. Using the real model class
keeps the conditioning path (tokenizer -> encoder -> last hidden states of the real tokens) the
one a full-size Wan recipe uses.

The folder holds both (``save_pretrained``), loadable offline with ``AutoTokenizer`` and
``UMT5EncoderModel.from_pretrained``: tokens are ``[PAD]`` (0), ``[UNK]`` (1), ``[EOS]`` (2), then
the vocabulary's words; text is lowercased and split on whitespace and punctuation, and ``[EOS]``
ends every caption (it is a real token, as in T5). ``manifest.json``, written last, records
``format_version``, ``seed``, ``vocabulary``, ``text_dim`` and ``max_length``. The vocabulary is
the ``vocabulary`` of a clip split's manifest (``data/build_moving_shapes.py``). Built once: a
folder whose manifest matches (version, seed, vocabulary) is kept.

    python data/build_text_encoder.py --clips data/cache/video/moving_shapes/train \\
        --out data/cache/video/text_encoder
"""

from __future__ import annotations

import argparse
import fcntl
import json
import shutil
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from veomni.data.builders import MANIFEST, staging_folder  # noqa: E402

FORMAT_VERSION = 1
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[EOS]")
TEXT_DIM = 64
MAX_LENGTH = 32
ENCODER_SHAPE = {"d_model": TEXT_DIM, "d_kv": 16, "num_heads": 4, "d_ff": 128, "num_layers": 2,
                 "relative_attention_num_buckets": 8, "relative_attention_max_distance": MAX_LENGTH}


def caption_vocabulary(clips_split: Path) -> list[str]:
    """The ``vocabulary`` a clip split's manifest lists."""
    try:
        return json.loads((clips_split / MANIFEST).read_text())["vocabulary"]
    except (OSError, ValueError, KeyError) as error:
        raise SystemExit(f"{clips_split / MANIFEST} lists no caption vocabulary ({error}); build the clips first: "
                         "python data/build_moving_shapes.py --train-out ... --eval-out ...") from error


def make_tokenizer(vocabulary: list[str]) -> PreTrainedTokenizerFast:
    vocab = {token: index for index, token in enumerate([*SPECIAL_TOKENS, *vocabulary])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A [EOS]",
                                                             special_tokens=[("[EOS]", vocab["[EOS]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="[EOS]", model_max_length=MAX_LENGTH)


def make_encoder(vocab_size: int, seed: int) -> UMT5EncoderModel:
    """A randomly initialised encoder; the same ``seed`` gives the same weights."""
    config = UMT5Config(vocab_size=vocab_size, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                        pad_token_id=0, eos_token_id=2, decoder_start_token_id=0, tie_word_embeddings=False,
                        **ENCODER_SHAPE)
    torch.manual_seed(seed)
    return UMT5EncoderModel(config).eval()


def is_current(out: Path, vocabulary: list[str], seed: int) -> bool:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (manifest.get("format_version"), manifest.get("seed"), manifest.get("vocabulary")) == (
        FORMAT_VERSION, seed, vocabulary)


def build_text_encoder(out: Path, vocabulary: list[str], seed: int = 0) -> None:
    """Write the encoder and tokenizer into ``out`` unless it is current; staged, then renamed,
    under a lock so concurrent launchers build it once."""
    if is_current(out, vocabulary, seed):
        print(f"cached: {out} is complete")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_current(out, vocabulary, seed):
            return
        tmp = staging_folder(out)
        tokenizer = make_tokenizer(vocabulary)
        tokenizer.save_pretrained(tmp)
        make_encoder(len(tokenizer), seed).save_pretrained(tmp)
        manifest = {"format_version": FORMAT_VERSION, "seed": seed, "text_dim": TEXT_DIM, "max_length": MAX_LENGTH,
                    "vocab_size": len(tokenizer), "vocabulary": vocabulary}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    print(f"{out}: UMT5 encoder (d_model {TEXT_DIM}, {ENCODER_SHAPE['num_layers']} layers, seed {seed}) and a "
          f"{len(tokenizer)}-token word-level tokenizer")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clips", required=True, type=Path, help="a clip split whose manifest lists the vocabulary")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    build_text_encoder(args.out, caption_vocabulary(args.clips), args.seed)


if __name__ == "__main__":
    main()
