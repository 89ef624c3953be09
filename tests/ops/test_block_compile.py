"""Every family's block compiles as one graph (``torch.compile(block, fullgraph=True)``): a graph
break splits a compiled block into pieces with eager Python between them, which on a GPU is the
host work and syncs compile is meant to remove (docs/performance.md, "CPU guards"). One tiny block
per family, compiled in place inside its model (what ``parallel.compile`` does, with
``fullgraph``), on the ``aot_eager`` backend: it traces forward and backward like inductor but
skips code generation, the slow part on a 2-core CPU; the loss must equal the eager model's."""

from __future__ import annotations

import pytest
import torch

from harness.perf_models import LLM_OPTIONS, MOE_OPTIONS, dit_batch, llm_batch, tiny_dit
from models.audio.config import AudioEncoderConfig
from models.audio.model import AudioEncoder
from models.vit.config import ViTConfig
from models.vit.model import NativeResolutionViT
from tests.graph_utils import community_graph, tiny_gnn, views
from tests.parity_utils import assert_scalar_parity
from veomni.contract import build_model
from veomni.tasks.lm import LanguageModelingTask
from veomni.tasks.node import NodeClassificationTask


def _lm(options: dict, arch: str = "llm", dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    _, model = build_model(arch, options)
    model.init_weights()
    model.to(dtype)
    batch = llm_batch()
    return model, lambda m: LanguageModelingTask()(m, batch).loss_sum


def _dit():
    batch = dit_batch()
    return tiny_dit(), lambda m: m(batch["noisy"], batch).pow(2).sum()


def _vit():
    torch.manual_seed(0)
    model = NativeResolutionViT(ViTConfig(patch_size=4, hidden_size=32, num_layers=2, num_heads=4,
                                          intermediate_size=64, out_hidden_size=24, init_std=0.1))
    model.init_weights()
    grid = torch.tensor([[1, 4, 4], [1, 2, 6]])
    patches = torch.randn(int(grid.prod(-1).sum()), model.config.patch_dim)
    return model, lambda m: m(patches, grid).pow(2).sum()


def _audio():
    torch.manual_seed(0)
    model = AudioEncoder(AudioEncoderConfig(n_mels=16, hidden_size=32, num_layers=2, num_heads=4,
                                            intermediate_size=64, out_hidden_size=24, init_std=0.1))
    model.init_weights()
    lengths = torch.tensor([13, 7])
    features = torch.randn(int(lengths.sum()), 16)
    return model, lambda m: m(features, lengths).pow(2).sum()


def _gnn():
    graph = community_graph()
    model = tiny_gnn(graph=graph)
    _, whole = views(graph, model, 1, 0, 1)
    return model, lambda m: NodeClassificationTask()(m, whole).loss_sum


FAMILIES = {
    "llm": lambda: _lm(LLM_OPTIONS),
    # bf16, as GPUs train: torch's fused grouped_mm traces only in bf16 (its fp32 form runs eager only)
    "moe": lambda: _lm(MOE_OPTIONS, dtype=torch.bfloat16),
    "vwn": lambda: _lm(LLM_OPTIONS, "vwn"),
    "dit": _dit,
    "vit": _vit,
    "audio": _audio,
    "gnn": _gnn,
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_first_block_compiles_as_one_graph_and_computes_the_eager_loss(family):
    model, loss_fn = FAMILIES[family]()
    expected = loss_fn(model).detach()
    torch._dynamo.reset()
    block = model.get_submodule(model.parallel_plan().blocks[0].replace("*", "0"))
    block.compile(fullgraph=True, backend="aot_eager")
    loss = loss_fn(model)
    loss.backward()
    if next(model.parameters()).dtype == torch.bfloat16:  # bf16 reordered by the compiler: close, not equal
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-2, atol=1e-2)
    else:
        assert_scalar_parity(float(loss.detach()), float(expected), f"{family}: compiled block's loss")
