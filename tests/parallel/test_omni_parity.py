"""The VLM under FSDP at 2 ranks equals one process, including a step in which one rank's
micro-batch holds no image (it runs the encoder on a dummy input, so the encoder's collectives
match on every rank and its gradient contribution is zero)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.gloo_ranks import run_distributed
from harness.media_bytes import png_bytes
from tests.omni_utils import TINY_OMNI, TOKENIZER, chat_record, tiny_omni
from tests.parity_utils import assert_records_close, assert_scalar_parity, full_grads, full_params
from veomni.config.schema import ParallelConfig
from veomni.contract import get_model_spec
from veomni.data.chat.media_dataset import SampleProcessor, pack_chat_samples
from veomni.data.text.packed import load_tokenizer
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.train.step import clip_and_step, forward_backward


def global_steps() -> list[list[dict]]:
    """Step -> samples. Rank r of 2 takes samples r, r+2, ...: in step 1 rank 1 gets only text."""
    image = lambda i: chat_record(f"s{i}", "What color is it?", ["red", "blue"][i % 2], png_bytes(i))  # noqa: E731
    text = lambda i: chat_record(f"t{i}", "Say yes or no.", "yes")  # noqa: E731
    return [
        [image(0), image(1), image(2), text(3), image(4), image(5)],
        [image(6), text(7), image(8), text(9)],
    ]


MOE_LLM = {**TINY_OMNI["llm"], "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "router_aux_loss_coef": 0.01}


def _run(rank: int, world: int, parallel: ParallelConfig, freeze: list[str], llm: dict) -> dict:
    dims = ParallelDims.resolve(parallel, world)
    meshes = build_mesh(dims, "cpu")
    config, model = tiny_omni(freeze=freeze, llm=llm)
    task = get_model_spec("omni").task(config)
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    model = parallelize(model, parallel, meshes, "cpu")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    record = {"loss": [], "grads": [], "metrics": [], "images": []}
    for samples in global_steps():
        batch = pack_chat_samples([process(r) for r in samples[rank::world]])
        record["images"].append(
            int(batch["media"]["image"]["inputs"]["grid_thw"].shape[0]) if "image" in batch["media"] else 0
        )
        metrics = forward_backward(model, task, [batch], meshes.loss.get_group(), dims.loss_size)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({k: v for k, v in metrics.items() if k == "moe/aux_loss"})
        record["grads"].append(full_grads(model))
        clip_and_step(model, optimizer, None, max_grad_norm=0.0)
    record["params"] = full_params(model)
    dist.barrier()
    return record


@pytest.mark.parametrize(
    "parallel, freeze, llm",
    [
        (ParallelConfig(), [], TINY_OMNI["llm"]),
        (ParallelConfig(activation_checkpointing="full"), ["llm"], TINY_OMNI["llm"]),
        (ParallelConfig(ep=2), [], MOE_LLM),
    ],
    ids=["fsdp2", "fsdp2-ac-full-frozen-llm", "moe-ep2"],
)
def test_fsdp_matches_single_process_with_a_rank_without_images(parallel, freeze, llm):
    reference = run_distributed(_run, 1, ParallelConfig(), freeze, llm)[0]
    results = run_distributed(_run, 2, parallel, freeze, llm)
    assert [r["images"][1] for r in results] == [2, 0]  # step 1: rank 1 has no image
    for got in results:
        assert_records_close(reference, got)
        for a, b in zip(reference["metrics"], got["metrics"]):
            assert a.keys() == b.keys()
            for k in a:
                assert_scalar_parity(b[k], a[k], k)
    if freeze:
        _, initial = tiny_omni(llm=llm)
        for name, value in initial.llm.named_parameters():
            torch.testing.assert_close(results[0]["params"][f"llm.{name}"], value.detach(), rtol=0, atol=0)
        assert not any(name.startswith("llm.") for name in reference["grads"][0])
