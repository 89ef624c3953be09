"""A tiny but complete run configuration (real tokenizer, real jsonl data) for trainer tests."""

from __future__ import annotations

import json
from pathlib import Path

from veomni.config.schema import (
    CheckpointConfig,
    DataConfig,
    LogConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainConfig,
)

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "tokenizers" / "stdlib-bpe-8k"


def write_corpus(folder: Path, documents: int = 60, seed: int = 0) -> Path:
    """A jsonl corpus of small, varied Python-ish documents."""
    import random

    rng = random.Random(seed)
    words = ["def", "return", "self", "import", "class", "value", "list", "path", "for", "in", "if", "None"]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "docs.jsonl"
    with path.open("w") as f:
        for i in range(documents):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 120)))
            f.write(json.dumps({"text": f"# doc {i}\n{text}"}) + "\n")
    return path


def tiny_run_config(tmp_path: Path, **train_overrides) -> RunConfig:
    train_dir = tmp_path / "corpus" / "train"
    eval_dir = tmp_path / "corpus" / "eval"
    if not train_dir.exists():
        write_corpus(train_dir, documents=80, seed=0)
        write_corpus(eval_dir, documents=12, seed=1)
    model = dict(vocab_size=8192, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=8, max_position_embeddings=256, family="qwen3", qk_norm=True)
    train = dict(output_dir=str(tmp_path / "out"), max_steps=6, seed=3, lr=3e-3, warmup_steps=2,
                 eval_batches=2, device="cpu")
    train.update(train_overrides)
    return RunConfig(
        model=ModelConfig(arch="llm", options=model),
        data=DataConfig(train_path=str(train_dir), eval_path=str(eval_dir), format="jsonl", text_key="text",
                        tokenizer=str(TOKENIZER), max_seq_len=64, tokens_per_micro_batch=128),
        parallel=ParallelConfig(),
        train=TrainConfig(**train),
        checkpoint=CheckpointConfig(interval=3, keep_last=5),
        log=LogConfig(progress_bar=False),
    )
