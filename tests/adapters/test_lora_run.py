"""A LoRA run through the trainer, on real gloo ranks: only the adapters train (the base after
training is the base before), a checkpoint holds only what trains (a small fraction of a full
run's) and a resume from it gives the same losses as the run that went on; a checkpoint resumes
only onto the base it was trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.parity_utils import full_params
from tests.trainer_utils import tiny_run_config
from veomni.config.schema import LoraConfig, ParallelConfig
from veomni.train.fault.stop import RunStopped
from veomni.train.trainer import Trainer

pytestmark = pytest.mark.full


def _config(tmp: str, out: str, lora: bool, whole: tuple[str, ...] = (), **train):
    cfg = tiny_run_config(Path(tmp), max_steps=6, **train)
    cfg.train.output_dir = str(Path(tmp) / out)
    cfg.parallel = ParallelConfig()
    if lora:
        cfg.lora = LoraConfig(rank=4, alpha=8.0, train=list(whole))
    if whole:  # a head of its own: a tied one goes out merged only (peft_io.saved_paths)
        cfg.model.options["tie_embeddings"] = False
    return cfg


def _train(rank, world, tmp, out, lora, max_steps=6, resume="auto", seed=3, whole=()):
    cfg = _config(tmp, out, lora, whole, seed=seed)
    cfg.checkpoint.resume = resume
    trainer = Trainer(cfg)
    before = full_params(trainer.model)
    trainer.cfg.train.max_steps = max_steps
    trainer.train()
    return before, full_params(trainer.model)


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "step_time_s" in r}


def _checkpoint_bytes(run_dir: Path, step: int) -> int:
    return sum(f.stat().st_size for f in (run_dir / "checkpoints" / f"step_{step:08d}").glob("*.distcp"))


def test_lora_trains_only_adapters_saves_them_alone_and_resumes_exactly(tmp_path):
    tmp = str(tmp_path)
    before, after = run_distributed(_train, 2, tmp, "lora", True)[0]
    adapters = [n for n in after if n.endswith(("lora_A", "lora_B"))]
    assert adapters and all(n.startswith("layers.") for n in adapters)
    assert any(not torch.equal(before[n], after[n]) for n in adapters if n.endswith("lora_B"))
    for name in after:
        if name not in adapters:
            torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)

    run_distributed(_train, 2, tmp, "full", False)
    lora_bytes, full_bytes = _checkpoint_bytes(tmp_path / "lora", 6), _checkpoint_bytes(tmp_path / "full", 6)
    assert 0 < lora_bytes < 0.2 * full_bytes, (lora_bytes, full_bytes)

    # resume at step 3 (its checkpoint) in a fresh run folder: the same losses as the run that went on
    straight = _losses(tmp_path / "lora")
    resumed_dir = tmp_path / "resumed"
    step3 = tmp_path / "lora" / "checkpoints" / "step_00000003"
    run_distributed(_train, 2, tmp, "resumed", True, 6, str(step3))
    resumed = _losses(resumed_dir)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])


def _resume_on_another_base(rank, world, tmp, checkpoint):
    try:
        _train(rank, world, tmp, "other", True, 6, checkpoint, seed=4)
    except RunStopped as exc:
        return str(exc)
    return "resumed"


def test_an_adapter_checkpoint_refuses_another_base(tmp_path):
    tmp = str(tmp_path)
    run_distributed(_train, 1, tmp, "lora", True, 3)
    checkpoint = str(tmp_path / "lora" / "checkpoints" / "step_00000003")
    message = run_distributed(_resume_on_another_base, 1, tmp, checkpoint)[0]
    assert "frozen base" in message and "'seed': 3" in message and "'seed': 4" in message


def test_a_lora_run_exports_as_peft_and_merged_folders_transformers_load(tmp_path):
    """A run on the seeded random base (no pretrained folder) that trains ``lm_head`` whole: the PEFT
    folder holds it as ``modules_to_save`` and names the base written beside it, and ``peft`` loads
    the two with the trained model's logits, as transformers loads the merged folder."""
    import peft
    import transformers

    from tests.parity_utils import assert_parity
    from veomni.checkpoint.export import main
    from veomni.checkpoint.lora_run import load_lora_checkpoint
    from veomni.config.load import load_config

    tmp = str(tmp_path)
    _, trained = run_distributed(_train, 1, tmp, "lora", True, 3, "auto", 3, ("lm_head",))[0]
    run_dir = tmp_path / "lora"
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert main([str(checkpoint), str(tmp_path / "merged"), "--peft", str(tmp_path / "peft")]) == 0
    model_cfg, ours = load_lora_checkpoint(checkpoint, load_config(run_dir / "config.yaml"))
    rebuilt = dict(ours.named_parameters())  # the base rebuilt from the recipe, the adapters from the checkpoint
    for name, value in trained.items():
        torch.testing.assert_close(rebuilt[name].detach(), value, rtol=0, atol=0, msg=name)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["lm_head"]
    assert config["base_model_name_or_path"] == str((tmp_path / "peft" / "base").resolve())
    ids = torch.randint(0, 8192, (10,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours.eval()(ids, torch.arange(10), torch.tensor([0, 10], dtype=torch.int32), 10)
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
        assert_parity(merged(ids[None]).logits[0], want, "merged export")
        plain = transformers.AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]).eval()
        assert (plain(ids[None]).logits[0] - want).abs().max() > 1e-4  # three steps moved the adapters
        adapted = peft.PeftModel.from_pretrained(plain, str(tmp_path / "peft")).eval()
        assert_parity(adapted(ids[None]).logits[0], want, "PEFT export on its exported base")
