"""Sharded construction: every layout starts from exactly the weights of a single process,
whether seeded or loaded from a Hugging Face folder."""

from pathlib import Path

import pytest
import torch

from harness.gloo_ranks import run_distributed
from models.llm.hf_adapter import config_to_hf
from tests.parity_utils import full_params
from tests.trainer_utils import tiny_run_config
from veomni.config.schema import ParallelConfig
from veomni.contract import build_model
from veomni.train.trainer import Trainer


def _params(rank, world, tmp, parallel, hf_dir):
    cfg = tiny_run_config(Path(tmp))
    cfg.parallel = parallel
    cfg.checkpoint.init_from_hf = hf_dir
    return full_params(Trainer(cfg).model)


def _single_process_init(tmp) -> dict[str, torch.Tensor]:
    cfg = tiny_run_config(Path(tmp))
    torch.manual_seed(cfg.train.seed)
    _, model = build_model("llm", cfg.model.options)
    model.init_weights()
    return dict(model.named_parameters())


@pytest.mark.parametrize("world, parallel", [(2, ParallelConfig()), (4, ParallelConfig(dp_replicate=2))],
                         ids=["fsdp2", "hsdp2x2"])
def test_sharded_init_equals_single_process(tmp_path, world, parallel):
    expected = _single_process_init(tmp_path)
    got = run_distributed(_params, world, str(tmp_path), parallel, None)
    for params in got:
        for name, value in expected.items():
            torch.testing.assert_close(params[name], value.detach(), rtol=0, atol=0, msg=name)


def test_init_from_hf_folder(tmp_path):
    import transformers

    cfg = tiny_run_config(tmp_path)
    model_cfg, _ = build_model("llm", cfg.model.options)
    torch.manual_seed(7)
    hf_model = transformers.AutoModelForCausalLM.from_config(config_to_hf(model_cfg))
    hf_dir = tmp_path / "hf"
    hf_model.save_pretrained(hf_dir)
    got = run_distributed(_params, 2, str(tmp_path), ParallelConfig(), str(hf_dir))[0]
    embed = hf_model.model.embed_tokens.weight.detach()
    torch.testing.assert_close(got["embed_tokens.weight"], embed, rtol=0, atol=0)
    q = hf_model.model.layers[1].self_attn.q_proj.weight.detach()
    torch.testing.assert_close(got["layers.1.attn.q_proj.weight"], q, rtol=0, atol=0)
