"""The pieces of the check for a checkpoint of another kind of run, fast: the identity record's
differences in words, and the key and shape comparison against a real DCP checkpoint's metadata
(written by ``torch.distributed.checkpoint`` in one process; no tensor is read to compare)."""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp

from veomni.checkpoint.run_identity import identity_differences, key_problems, stored_shapes

FULL = {"model": {"arch": "llm", "hidden_size": 32, "num_layers": 2}, "lora": None}
LORA = {"model": FULL["model"], "lora": {"arch": "llm", "seed": 42, "pretrained": {},
                                         "lora": {"rank": 4, "alpha": 16.0, "targets": [], "train": []}}}


def test_identity_differences_name_the_kind_and_each_field():
    assert identity_differences(FULL, FULL) == [] and identity_differences(LORA, LORA) == []
    assert identity_differences(FULL, LORA) == ["it was written by a run that trained the whole model (full "
                                                "fine-tuning), and this run trains LoRA adapters"]
    assert identity_differences(LORA, FULL) == ["it was written by a run that trained LoRA adapters, and this run "
                                                "trains the whole model (full fine-tuning)"]
    wider = {**FULL, "model": {**FULL["model"], "hidden_size": 64}}
    assert identity_differences(FULL, wider) == ["model.hidden_size: checkpoint 32, recipe 64"]
    other_rank = {**LORA, "lora": {**LORA["lora"], "lora": {**LORA["lora"]["lora"], "rank": 8}}}
    assert identity_differences(LORA, other_rank) == ["lora.rank: checkpoint 4, recipe 8"]


def test_key_problems_read_the_metadata(tmp_path):
    dcp.save({"model": {"layers.0.q_proj.weight": torch.zeros(8, 4), "norm.weight": torch.ones(4)},
              "app": {"step": 3}}, checkpoint_id=str(tmp_path))
    stored = stored_shapes(tmp_path)
    assert stored["model.layers.0.q_proj.weight"] == (8, 4) and stored["app.step"] is None
    assert key_problems(tmp_path, {"layers.0.q_proj.weight": (8, 4), "norm.weight": (4,)}) == []
    assert key_problems(tmp_path, {"layers.0.q_proj.lora_A": (2, 4), "norm.weight": (4,)}) == [
        "it lacks 1 of this model's weights (layers.0.q_proj.lora_A)"]
    assert key_problems(tmp_path, {"layers.0.q_proj.weight": (16, 4)}) == [
        "weights of other shapes: layers.0.q_proj.weight [8, 4] in the checkpoint, [16, 4] here"]
