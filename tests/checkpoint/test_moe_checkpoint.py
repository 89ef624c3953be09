"""MoE checkpoints across expert-parallel layouts: saved at ep=4 (4 ranks), resumed at ep=2 and
ep=1 with identical weights and optimizer state and the same next-step loss; exported to HF
from the ep=4 checkpoint with every expert intact."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from harness.gloo_ranks import run_distributed
from tests.parity_utils import assert_parity, assert_scalar_parity, full_params
from tests.trainer_utils import tiny_run_config
from veomni.checkpoint.export import main as export_main
from veomni.contract import build_model
from veomni.train.trainer import Trainer

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, router_aux_loss_coef=0.01)


def _config(tmp: str, ep: int, max_steps: int):
    cfg = tiny_run_config(Path(tmp), max_steps=max_steps)
    cfg.model.options.update(MOE)
    cfg.parallel.ep = ep
    return cfg


def _exp_avg(trainer):
    return {k: (v["exp_avg"].full_tensor() if hasattr(v["exp_avg"], "full_tensor") else v["exp_avg"])
            for k, v in trainer.optimizer.state_dict()["state"].items()}


def _train(rank, world, tmp, ep):
    trainer = Trainer(_config(tmp, ep, max_steps=3))
    history = trainer.train()
    assert all("moe/tokens_per_expert" in m for m in history)
    return full_params(trainer.model), _exp_avg(trainer)


def _resume(rank, world, tmp, ep):
    trainer = Trainer(_config(tmp, ep, max_steps=4))
    params, avg, step = full_params(trainer.model), _exp_avg(trainer), trainer.step
    return params, avg, step, trainer.run_step()["loss"]


def test_saved_at_ep4_resumes_at_ep2_and_ep1_and_exports(tmp_path):
    saved_params, saved_avg = run_distributed(_train, 4, str(tmp_path), 4)[0]
    assert saved_params["layers.0.mlp.experts.gate_up_proj"].shape[0] == 8  # global, not a shard
    losses = {}
    for ep in (2, 1):
        params, avg, step, losses[ep] = run_distributed(_resume, 2, str(tmp_path), ep)[0]
        assert step == 3
        for name, value in saved_params.items():
            torch.testing.assert_close(params[name], value, rtol=0, atol=0, msg=f"ep={ep} {name}")
        for key, value in saved_avg.items():
            torch.testing.assert_close(avg[key], value, rtol=0, atol=0, msg=f"ep={ep} exp_avg {key}")
    assert_scalar_parity(losses[2], losses[1], "ep=2 loss")  # same data (dp=2), EP only changes the layout

    cfg = _config(str(tmp_path), 4, 3)
    out = tmp_path / "hf"
    assert export_main([str(Path(cfg.train.output_dir) / "checkpoints" / "step_00000003"), str(out)]) == 0
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    gate_up = hf.model.layers[1].mlp.experts.gate_up_proj.detach()
    torch.testing.assert_close(gate_up, saved_params["layers.1.mlp.experts.gate_up_proj"], rtol=0, atol=0)
    _, ours = build_model("llm", cfg.model.options)
    ours.load_state_dict({**saved_params, **{n: b for n, b in ours.named_buffers()}}, strict=False)
    ids = torch.arange(3, 40)
    with torch.no_grad():
        ours_logits = ours(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)], dtype=torch.int32), len(ids))
        assert_parity(hf(ids[None]).logits[0], ours_logits, "exported logits in transformers")
