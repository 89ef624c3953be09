"""A checkpoint written by a 2-rank FSDP run exports to a folder transformers loads as-is."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness.gloo_ranks import run_distributed
from tests.parity_utils import assert_parity, full_params
from tests.trainer_utils import tiny_run_config
from veomni.checkpoint.export import main as export_main
from veomni.contract import build_model
from veomni.train.trainer import Trainer


def _train(rank, world, tmp):
    trainer = Trainer(tiny_run_config(Path(tmp), max_steps=2))
    trainer.train()
    return full_params(trainer.model)


def test_exported_checkpoint_loads_in_transformers_with_same_logits(tmp_path):
    params = run_distributed(_train, 2, str(tmp_path))[0]
    cfg = tiny_run_config(tmp_path)
    checkpoint = Path(cfg.train.output_dir) / "checkpoints" / "step_00000002"
    out = tmp_path / "hf"
    assert export_main([str(checkpoint), str(out)]) == 0

    _, ours = build_model("llm", cfg.model.options)
    result = ours.load_state_dict(params, strict=False)  # lm_head is tied to the embedding
    assert set(result.missing_keys) <= {"lm_head.weight"} and not result.unexpected_keys
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = tokenizer("def export(path):\n    return path", return_tensors="pt")["input_ids"][0]
    n = len(ids)
    with torch.no_grad():
        ours_logits = ours(ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n)
        hf_logits = hf(ids[None]).logits[0]
    assert_parity(hf_logits, ours_logits, "exported logits in transformers")


def test_export_rejects_incomplete_checkpoint(tmp_path, capsys):
    (tmp_path / "step_00000001").mkdir()
    assert export_main([str(tmp_path / "step_00000001"), str(tmp_path / "out")]) == 2
    assert "not a complete checkpoint" in capsys.readouterr().err
