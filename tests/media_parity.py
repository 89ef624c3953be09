"""Shared harness of the media-routing parity tests (``tests/parallel/test_colocate.py``,
``tests/parallel/test_media_sp.py``): the tiny omni model trained on fixed chat records, one process or
several real gloo ranks, with what each rank's image encoder ran recorded beside the loss and
gradients."""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.media_bytes import png_bytes
from models.omni.modality_registry import get_modality
from tests.omni_utils import TOKENIZER, chat_record, tiny_omni, tiny_qwen_vl_chat
from tests.parity_utils import full_grads, full_params
from veomni.config.schema import ParallelConfig
from veomni.contract import get_model_spec
from veomni.data.chat.media_dataset import SampleProcessor
from veomni.data.text.packed import load_tokenizer
from veomni.parallel.apply import parallelize
from veomni.parallel.media.encoder_work import watch_encoder_work
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.row_split import shard_batch
from veomni.train.step import clip_and_step, forward_backward


def image(i: int, width: int | None = None, height: int | None = None) -> dict:
    return chat_record(f"s{i}", "What color is it?", ["red", "blue"][i % 2], png_bytes(i, width, height or width))


def text(i: int) -> dict:
    return chat_record(f"t{i}", "Say yes or no.", "yes")


def run_media_steps(rank: int, world: int, parallel: ParallelConfig, steps: list[list[dict]],
                    overrides: dict | None = None, arch: str = "omni") -> dict:
    """Train the tiny omni model (``overrides`` of ``TINY_OMNI``; ``arch="qwen2_5_vl"``: of
    ``TINY_QWEN_VL_CHAT``, rows with M-RoPE positions) with SGD, one micro-batch per step:
    data-parallel rank d of D packs samples d, d + D, ... of each step's records, and under
    sequence parallelism keeps its slice of that row. Records per step the global loss, the
    task's loss terms, the full gradients, the image encoder FLOPs of the items this rank's row
    holds (``owned``) and of the real images this rank encoded whole (``encoded``), and the patch
    rows it held in sequence-parallel runs of long images (``shared``); then the final
    parameters."""
    meshes = build_mesh(ParallelDims.resolve(parallel, world), "cpu")
    dims = meshes.dims
    config, model = (tiny_omni if arch == "omni" else tiny_qwen_vl_chat)(**(overrides or {}))
    task = get_model_spec(arch).task(config)
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    model = parallelize(model, parallel, meshes, "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    work = watch_encoder_work([model], "image")
    if "image" in model.encoders:
        encoder, modality = model.encoders["image"], get_modality("image")
    record = {"loss": [], "metrics": [], "grads": [], "owned": [], "encoded": [], "shared": []}
    for samples in steps:
        batch = process.pack([process(r) for r in samples[meshes.dp_rank::dims.dp_size]])
        if dims.row_ranks > 1:
            batch = shard_batch(batch, meshes.row_split, task.contract)
        if "image" in model.encoders:
            inputs = batch["media"].get("image", {}).get("inputs")
            record["owned"].append(modality.flops(encoder, inputs) if inputs is not None else 0.0)
        metrics = forward_backward(model, task, [batch], meshes.loss.get_group(), dims.loss_size, dims.row_ranks)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({k: v for k, v in metrics.items() if k.startswith("loss_")})
        record["grads"].append(full_grads(model))
        record["encoded"].append(work.whole)
        record["shared"].append(work.share_rows)
        work.reset()
        clip_and_step(model, optimizer, None, max_grad_norm=0.0)
    record["params"] = full_params(model)
    dist.barrier()
    return record
