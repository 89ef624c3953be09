"""Train the byte-level BPE tokenizer shipped in ``data/tokenizers/stdlib-bpe-8k``.

Why our own: an 8k vocabulary fitted to the stdlib corpus keeps the quickstart models small and
needs no download. Byte-level BPE covers any input (no unknown token). Special tokens:
``<|endoftext|>`` (id 0, the eos appended to every document) and ``<|pad|>``. The result is
saved with ``save_pretrained`` so ``AutoTokenizer.from_pretrained(folder)`` loads it offline.

    python data/build_stdlib_corpus.py --train-out data/cache/stdlib/train --eval-out data/cache/stdlib/eval
    python data/train_tokenizer.py --train-path data/cache/stdlib/train --out data/tokenizers/stdlib-bpe-8k
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from veomni.data.sources import ReadStats, iter_texts, resolve_files

EOS, PAD = "<|endoftext|>", "<|pad|>"


def train(train_path: str, vocab_size: int) -> Tokenizer:
    """Fit byte-level BPE on every document of the split at ``train_path``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    fmt, files = resolve_files(train_path)
    texts = iter_texts(files, fmt, "txt", max_bad_fraction=0.0, stats=ReadStats())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-path", default="data/cache/stdlib/train")
    parser.add_argument("--out", type=Path, default=Path("data/tokenizers/stdlib-bpe-8k"))
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args()

    start = time.perf_counter()
    tokenizer = train(args.train_path, args.vocab_size)
    assert tokenizer.token_to_id(EOS) == 0, "eos must be id 0"
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD)
    wrapped.save_pretrained(str(args.out))
    print(f"vocab {tokenizer.get_vocab_size()} saved to {args.out} in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
