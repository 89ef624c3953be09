"""The media encoders' own FSDP group (``parallel.encoder_fsdp``): at 4 gloo ranks the tiny VLM
with its encoder replicated (1), sharded 2-way or sharded like the LLM trains exactly like one
process; the encoder's parameters sit on the (replicate, shard) mesh asked for while the LLM's
stay sharded 4-way; and sizes that cannot apply are refused before any worker starts."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.gloo_ranks import run_distributed
from tests.media_parity import run_media_steps
from tests.omni_utils import TINY_OMNI, tiny_omni
from tests.parallel.test_colocate import global_steps
from tests.parity_utils import assert_records_close
from veomni.config.schema import ParallelConfig
from veomni.contract import build_model
from veomni.parallel.apply import parallelize
from veomni.parallel.fsdp import check_encoder_fsdp
from veomni.parallel.mesh import LayoutError, ParallelDims, build_mesh


@pytest.fixture(scope="module")
def reference() -> dict:
    return run_distributed(run_media_steps, 1, ParallelConfig(), global_steps())[0]


@pytest.mark.parametrize("parallel", [ParallelConfig(encoder_fsdp=1),
                                      ParallelConfig(encoder_fsdp=2, encoder_balance=True)],
                         ids=["replicated", "sharded-2-balanced"])
def test_encoder_own_fsdp_group_matches_one_process(reference, parallel):
    for got in run_distributed(run_media_steps, 4, parallel, global_steps()):
        assert_records_close(reference, got)


def _mesh_shapes(rank: int, world: int, parallel: ParallelConfig) -> dict:
    meshes = build_mesh(ParallelDims.resolve(parallel, world), "cpu")
    _, model = tiny_omni()
    model = parallelize(model, parallel, meshes, "cpu")
    encoder, llm = model.encoders["image"], model.llm
    shapes = {"encoder_block": tuple(next(encoder.blocks.parameters()).device_mesh.shape),
              "encoder_root": tuple(encoder.patch_embed.weight.device_mesh.shape),
              "llm_block": tuple(next(llm.layers.parameters()).device_mesh.shape)}
    dist.barrier()
    return shapes


@pytest.mark.parametrize("size, expected", [(1, (4, 1)), (2, (2, 2)), (0, (4,))])
def test_encoder_parameters_sit_on_their_own_mesh(size, expected):
    shapes = run_distributed(_mesh_shapes, 4, ParallelConfig(encoder_fsdp=size))[0]
    assert shapes == {"encoder_block": expected, "encoder_root": expected, "llm_block": (4,)}


def test_encoder_fsdp_sizes_that_cannot_apply_are_refused():
    with pytest.raises(LayoutError, match=r"encoder_fsdp=3 must divide .* = 4; pick one of \[1, 2, 4\]"):
        ParallelDims.resolve(ParallelConfig(encoder_fsdp=3), 4)
    with torch.device("meta"):
        _, llm = build_model("llm", TINY_OMNI["llm"])
    assert "declares no encoders" in check_encoder_fsdp(llm, 2)[0]
    assert check_encoder_fsdp(llm, 0) == []
