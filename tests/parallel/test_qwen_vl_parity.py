"""The ``qwen2_5_vl`` family (windowed tower, 2-frame temporal patches, M-RoPE positions [T, 3]) trains
like one process under FSDP at 2 ranks, under LLM sequence parallelism at sp=2 and with its videos
run sequence-parallel in the tower over both ranks (``parallel.encoder_sp``) on real gloo ranks:
losses, full gradients and parameters after SGD steps. The steps hold images of different sizes,
videos, text-only samples, and (FSDP, encoder_sp) a step in which one rank's row has no media;
under sp=2 the (t, h, w) positions are sliced with the row like any sequence field."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.gloo_ranks import run_distributed
from models.omni.mrope_positions import token_types
from tests.parity_utils import assert_records_close, full_grads, full_params
from veomni.config.schema import ParallelConfig
from veomni.contract import build_model, get_model_spec
from veomni.data.packing import pack_samples
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.row_split import shard_batch
from veomni.train.step import clip_and_step, forward_backward

IMAGE, VIDEO, START, END = 60, 61, 62, 63
TINY_QWEN_VL = dict(
    llm=dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=2, num_kv_heads=1,
             head_dim=None, family="qwen2", qkv_bias=True, qk_norm=False, tie_embeddings=False,
             mrope_section=[2, 3, 3], max_position_embeddings=256),
    encoders={"image": dict(patch_size=2, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=24,
                            hidden_act="silu", merge_mode="concat", out_hidden_size=32, temporal_patch_size=2,
                            norm="rmsnorm", mlp="gated", window_size=8, full_attention_layers=[1],
                            max_pixels=56 * 56)},
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
    tokens_per_second=2,
)
# Step -> samples -> media grids (t, h, w in patches; t > 1: a video). Rank d of 2 takes samples
# d, d + 2, ...: in step 1, rank 0's row is text only.
STEPS = [
    [[(1, 4, 6), (2, 6, 6)], [], [(1, 6, 4)], [(1, 2, 2)]],
    [[], [(1, 4, 4)], [], [(2, 4, 4)]],
]


def _sample(seed: int, grids: list[tuple[int, int, int]], patch_dim: int):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 56, (5,), generator=gen)]
    patches = []
    for t, h, w in grids:
        ids += [torch.tensor([START]), torch.full((t * h * w // 4,), VIDEO if t > 1 else IMAGE),
                torch.tensor([END]), torch.randint(0, 56, (3,), generator=gen)]
        patches.append(torch.randn(t * h * w, patch_dim, generator=gen))
    return torch.cat(ids).tolist(), patches


def _row(config, step: int, picked: list[int]) -> dict:
    """One packed row of samples ``picked`` of the step: ids, labels, M-RoPE positions [T, 3], and
    every item of the row in order."""
    patch_dim = config.encoder_configs["image"].patch_dim
    samples = [STEPS[step][i] for i in picked]
    made = [_sample(100 * step + i, STEPS[step][i], patch_dim) for i in picked]
    batch = pack_samples([ids for ids, _ in made])
    grids = [g for g_list in samples for g in g_list]
    images = torch.tensor([g for g in grids if g[0] == 1]).view(-1, 3)
    videos = torch.tensor([g for g in grids if g[0] > 1]).view(-1, 3)
    batch["position_ids"] = config.position_ids(batch["input_ids"], batch["cu_seqlens"], images, videos,
                                                torch.full((len(videos),), 1.5))
    batch["media"] = {}
    if grids:
        batch["media"]["image"] = {
            "inputs": {"patches": torch.cat([p for _, ps in made for p in ps]), "grid_thw": torch.tensor(grids)},
            "positions": torch.nonzero(token_types(batch["input_ids"], IMAGE, VIDEO)).flatten(),
        }
    return batch


def _run(rank: int, world: int, parallel: ParallelConfig) -> dict:
    meshes = build_mesh(ParallelDims.resolve(parallel, world), "cpu")
    dims = meshes.dims
    torch.manual_seed(0)
    config, model = build_model("qwen2_5_vl", TINY_QWEN_VL)
    model.init_weights()
    task = get_model_spec("qwen2_5_vl").task(config)
    model = parallelize(model, parallel, meshes, "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record = {"loss": [], "metrics": [], "grads": [], "media": []}
    for step, samples in enumerate(STEPS):
        batch = _row(config, step, list(range(len(samples)))[meshes.dp_rank::dims.dp_size])
        record["media"].append(len(batch["media"]))
        if dims.row_ranks > 1:
            batch = shard_batch(batch, meshes.row_split, task.contract)
        metrics = forward_backward(model, task, [batch], meshes.loss.get_group(), dims.loss_size, dims.row_ranks)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({k: v for k, v in metrics.items() if k.startswith("loss_")})
        record["grads"].append(full_grads(model))
        clip_and_step(model, optimizer, None, max_grad_norm=0.0)
    record["params"] = full_params(model)
    dist.barrier()
    return record


# encoder_sp: items over 24 patches are long, the two videos (72 and 32 patches; windows of 2 x 2
# merged tokens, partial in the 3 x 3 frames of the first): rank 0 holds the first, rank 1 the second
@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(sp=2),
                                      ParallelConfig(encoder_sp=2, encoder_sp_threshold=24)],
                         ids=["fsdp2", "sp2", "encoder-sp2"])
def test_qwen_vl_matches_single_process(parallel):
    reference = run_distributed(_run, 1, ParallelConfig())[0]
    results = run_distributed(_run, 2, parallel)
    if parallel.sp == 1:
        assert [r["media"][1] for r in results] == [0, 1]  # step 1: rank 0's row has no media
    for got in results:
        assert_records_close(reference, got)
