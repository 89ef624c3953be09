"""Omni models under pipeline parallelism (veomni/parallel/media/pipeline_encoders.py): the tiny VLM at
pp=2 (GPipe, 1F1B) and pp=2 x dp=2, and the audio model at pp=2, train exactly like one process
(fp32, SGD: loss, every gradient including the encoders', every updated parameter), on steps
where a micro-batch or a whole data-parallel rank has no media and where one image is much larger
than the others; with the encoders colocated on every rank and run inline in the first stage;
and the schedules that cannot take media are refused before any worker starts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harness.gloo_ranks import run_distributed
from harness.media_bytes import png_bytes
from models.audio.processing import encode_wav
from models.omni.modality_registry import get_modality
from tests.omni_utils import TINY_OMNI, TOKENIZER, chat_record
from tests.parity_utils import assert_records_close, full_grads, full_params
from veomni.config.schema import ParallelConfig, TrainConfig
from veomni.contract import build_model, get_model_spec
from veomni.data.chat.media_dataset import SampleProcessor
from veomni.data.text.packed import load_tokenizer
from veomni.optim import build_optimizer
from veomni.parallel.apply import PIPELINE_HOOKS, parallelize
from veomni.parallel.media.colocate import check_media_routing
from veomni.parallel.media.encoder_work import watch_encoder_work
from veomni.parallel.mesh import LayoutError, ParallelDims, build_mesh
from veomni.parallel.pipeline.layout import PipelineConfigError
from veomni.parallel.pipeline.stages import build_pipeline, check_pipeline_model
from veomni.train.runners.pipeline_step import pipeline_forward_backward
from veomni.train.step import clip_and_step, forward_backward

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

MICROBATCHES = 2
VLM = {**TINY_OMNI, "llm": {**TINY_OMNI["llm"], "tie_embeddings": False}}
AUDIO = {"llm": VLM["llm"], "encoders": {"audio": dict(n_mels=16, hidden_size=32, num_layers=2, num_heads=4,
                                                        intermediate_size=64, out_hidden_size=32)}}


def image(i: int, width: int | None = None) -> dict:
    return chat_record(f"s{i}", "What color is it?", ["red", "blue"][i % 2], png_bytes(i, width, width))


def text(i: int) -> dict:
    return chat_record(f"t{i}", "Say yes or no.", "yes")


def clip(i: int, seconds: float) -> dict:
    wave = 0.5 * np.sin(2 * np.pi * (220 + 110 * i) * np.arange(int(seconds * 16000)) / 16000)
    record = chat_record(f"a{i}", "What sound is it?", "a tone")
    record["json"] = record["json"].replace(b"What sound", b"<audio>\\nWhat sound")
    record["wav"] = encode_wav(wave, 16000)
    return record


def vlm_steps() -> list[list[dict]]:
    """Rank r of a dp group of N takes samples r, r + N, ...; micro-batch i the i-th half of those.
    Step 0: at dp=2 rank 1 has no image; step 1: one 84x84 image (81x the attention of a 28x28
    one) among small ones; step 2: one micro-batch without image at dp=1, at dp=2 rank 1 none."""
    return [
        [image(0), text(1), text(3), text(5), image(2), text(7), text(9), text(11)],
        [image(6, 84), image(7, 28), image(8, 28), image(9, 28)],
        [image(12, 84), text(13), text(14), text(15)],
    ]


def audio_steps() -> list[list[dict]]:
    return [[clip(0, 0.5), text(1), clip(2, 0.2), text(3)], [clip(4, 1.0), clip(5, 0.1), text(6), text(7)]]


def build(options: dict, arch: str = "omni"):
    torch.manual_seed(0)
    return build_model(arch, options)[1]


def batches(options: dict, steps: list[list[dict]], dp_rank: int, dp: int, arch: str = "omni") -> list[list[dict]]:
    """Per step, this data-parallel rank's micro-batches (packed by the family's layout: a
    ``qwen2_5_vl`` row carries M-RoPE positions [T, 3])."""
    with torch.device("meta"):
        config, _ = build_model(arch, options)
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    out = []
    for samples in steps:
        mine = [process(r) for r in samples[dp_rank::dp]]
        half = -(-len(mine) // MICROBATCHES)
        out.append([process.pack(mine[i * half:(i + 1) * half]) for i in range(MICROBATCHES)])
    return out


def _reference(rank: int, world: int, options: dict, steps: list[list[dict]], arch: str = "omni") -> dict:
    model = build(options, arch)
    model.init_weights()
    task = get_model_spec(arch).task(model.config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record = {"loss": [], "metrics": [], "grads": []}
    for micro_batches in batches(options, steps, 0, 1, arch):
        metrics = forward_backward(model, task, micro_batches, None, 1)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({})
        record["grads"].append(full_grads(model))
        clip_and_step(model, optimizer, None, 0.0)
    record["params"] = full_params(model)
    return record


def _pipelined(rank: int, world: int, parallel: ParallelConfig, options: dict, steps: list[list[dict]],
               stage_aware: bool = False, arch: str = "omni") -> dict:
    """Also records per step the image encoder FLOPs of the images this rank's dp group holds
    (``owned``, counted on its first stage), of the real images this rank encoded whole
    (``encoded``) and the patch rows it held in sequence-parallel runs of long images
    (``shared``), and this rank's pipeline rank (``pp_rank``). Unless ``stage_aware``, the items
    are placed as if the stages had no work of their own (the tiny LLM's last stage holds the
    8200-word head, which would otherwise keep every item on the first stage), so the spreading
    itself is exercised."""
    dims = ParallelDims.resolve(parallel, world)
    meshes = build_mesh(dims, "cpu")
    with torch.device("meta"):
        meta = build(options, arch)
    task = get_model_spec(arch).task(meta.config)
    pipe = build_pipeline(lambda: build(options, arch), lambda m: m.init_weights(),
                          lambda m: parallelize(m, parallel, meshes, "cpu"), parallel, MICROBATCHES, meshes.pp,
                          torch.device("cpu"), task, meshes, hooks=PIPELINE_HOOKS)
    if pipe.encoders is not None and not stage_aware:
        pipe.encoders.stage_work = None
    optimizer = build_optimizer(pipe.modules, TrainConfig(optimizer="sgd", lr=0.1, weight_decay=0.0))
    every = [batches(options, steps, r, dims.dp_size, arch) for r in range(dims.dp_size)]
    row = max(task.contract.row_length(mb) for rank_steps in every for step in rank_steps for mb in step)
    colocated = pipe.encoders is not None and "image" in pipe.encoders.names
    encoder = pipe.encoders.part.media_encoder("image") if colocated else None
    modality, work = get_modality("image"), watch_encoder_work(pipe.modules, "image")
    record = {"loss": [], "metrics": [], "grads": [], "grad_norm": [], "owned": [], "encoded": [], "shared": [],
              "pp_rank": meshes.pp.get_local_rank()}
    for micro_batches in every[meshes.dp_rank]:
        if encoder is not None:
            inputs = [mb["media"]["image"]["inputs"] for mb in micro_batches if "image" in mb.get("media", {})]
            record["owned"].append(sum(modality.flops(encoder, i) for i in inputs) if pipe.has_first_stage else 0.0)
        metrics = pipeline_forward_backward(pipe, task, micro_batches, meshes.loss.get_group(), dims.loss_size,
                                            dims.pp, row, meta)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({})
        record["grads"].append({k: v for part in pipe.modules for k, v in full_grads(part).items()})
        record["encoded"].append(work.whole)
        record["shared"].append(work.share_rows)
        work.reset()
        stepped = clip_and_step(pipe.modules, optimizer, None, 0.0, meshes.pp.get_group(), uncounted=pipe.uncounted)
        record["grad_norm"].append(stepped["grad_norm"])
    record["params"] = {k: v for part in pipe.modules for k, v in full_params(part).items()}
    return record


def merged(records: list[dict]) -> dict:
    out = {"loss": records[0]["loss"], "metrics": records[0]["metrics"], "params": {},
           "grads": [{} for _ in records[0]["grads"]]}
    for rec in records:
        assert rec["loss"] == pytest.approx(records[0]["loss"], abs=1e-9)
        assert rec["grad_norm"] == pytest.approx(records[0]["grad_norm"], rel=1e-6)
        out["params"].update(rec["params"])
        for step, grads in enumerate(rec["grads"]):
            out["grads"][step].update(grads)
    return out


@pytest.fixture(scope="module")
def vlm_reference() -> dict:
    return run_distributed(_reference, 1, VLM, vlm_steps())[0]


def check(reference: dict, records: list[dict]) -> None:
    got = merged(records)
    assert sorted(got["params"]) == sorted(reference["params"]), "every parameter held, encoders included"
    assert any(k.startswith("encoders.") for k in got["grads"][0])
    assert_records_close(reference, got)
    # (rel: the fp32 norm of 8200 x 32 embedding gradients. The tiny encoders' share of the squared
    # norm is below 1e-3 here, so this checks the norm's plumbing, not that they count once.)
    norm = sum(float(g.double().pow(2).sum()) for g in reference["grads"][-1].values()) ** 0.5
    assert records[0]["grad_norm"][-1] == pytest.approx(norm, rel=1e-4)


def check_spread(records: list[dict], steps: range | None = None) -> None:
    """Every image encoded whole exactly once (on the given ``steps``, all by default) and some by
    ranks that run no first stage: the encoder work is spread over the pipeline."""
    for step in steps if steps is not None else range(len(records[0]["encoded"])):
        assert sum(r["encoded"][step] for r in records) == pytest.approx(sum(r["owned"][step] for r in records))
    assert sum(sum(r["encoded"]) for r in records if r["pp_rank"] > 0) > 0


@pytest.mark.parametrize("schedule, colocate", [("GPipe", True), ("1F1B", True), ("1F1B", False)],
                         ids=["gpipe", "1f1b", "1f1b-inline"])
def test_vlm_pp2_matches_one_process(vlm_reference, schedule, colocate):
    parallel = ParallelConfig(pp=2, pp_schedule=schedule, encoder_colocate=colocate)
    records = run_distributed(_pipelined, 2, parallel, VLM, vlm_steps())
    check(vlm_reference, records)
    if colocate:
        check_spread(records)
    else:  # inline: the first stage encodes every image
        assert sum(records[0]["encoded"]) > 0 and sum(records[1]["encoded"]) == 0


def test_items_are_placed_around_the_stages_own_work(vlm_reference):
    """With the stages' FLOPs counted, the last stage (a 32-wide block besides an
    8200 x 32 head, far more than every image of a step) encodes nothing and the first does it all."""
    records = run_distributed(_pipelined, 2, ParallelConfig(pp=2, pp_schedule="1F1B"), VLM, vlm_steps(), True)
    check(vlm_reference, records)
    assert sum(records[0]["encoded"]) > 0 and sum(records[1]["encoded"]) == 0


@pytest.mark.parametrize("extra", [{}, {"encoder_balance": True}, {"encoder_fsdp": 2}],
                         ids=["spread-in-dp-group", "balanced", "encoder-fsdp2"])
def test_vlm_pp2_x_dp2_matches_one_process(vlm_reference, extra):
    parallel = ParallelConfig(pp=2, pp_schedule="1F1B", **extra)
    records = run_distributed(_pipelined, 4, parallel, VLM, vlm_steps())
    check(vlm_reference, records)
    check_spread(records)
    if not extra.get("encoder_balance"):  # the items stay within their data-parallel group (dp rank = rank % 2)
        assert all(r["encoded"][0] == 0 for r in records[1::2])  # dp rank 1 has no image in step 0


BIG = {**VLM, "encoders": {"image": {**VLM["encoders"]["image"], "max_pixels": 168 * 168}}}
LONG_STEP, THRESHOLD = 0, 32  # patches: the 168x168 image (144 of them) is long, the 56x56 one (16) is not


def long_steps() -> list[list[dict]]:
    """Step 0: one very large image (168x168) among small ones; step 1: one micro-batch without
    image (at dp=2: data-parallel rank 1 has none at all)."""
    return [[image(0, 168), image(1, 28), image(2, 28), text(3)], [image(4, 56), text(5), text(6), text(7)]]


@pytest.mark.parametrize("world, extra", [(2, {}), (4, {"encoder_balance": True})],
                         ids=["pp2", "pp2xdp2-balanced"])
def test_long_image_runs_sequence_parallel_under_pp(world, extra):
    reference = run_distributed(_reference, 1, BIG, long_steps())[0]
    parallel = ParallelConfig(pp=2, pp_schedule="1F1B", encoder_sp=2, encoder_sp_threshold=THRESHOLD, **extra)
    records = run_distributed(_pipelined, world, parallel, BIG, long_steps())
    check(reference, records)
    shared = [r["shared"][LONG_STEP] for r in records]
    assert sum(shared) == 144 and sorted(shared)[-2:] == [72, 72]  # the big image, over a block of 2 ranks
    assert all(r["shared"][1] == 0 for r in records)
    check_spread(records, range(1, 2))


def test_audio_pp2_matches_one_process():
    reference = run_distributed(_reference, 1, AUDIO, audio_steps())[0]
    check(reference, run_distributed(_pipelined, 2, ParallelConfig(pp=2, pp_schedule="1F1B"), AUDIO, audio_steps()))


@pytest.mark.parametrize("parallel, message", [
    (ParallelConfig(pp=2, pp_schedule="Interleaved1F1B"), "one stage per rank"),
    (ParallelConfig(pp=2, pp_schedule="ZBVZeroBubble"), "one stage per rank"),
    (ParallelConfig(pp=2, sp=2), "not pipelined with sequence or context parallelism"),
])
def test_media_pipelines_refuse_what_they_cannot_run(parallel, message):
    with torch.device("meta"):
        model = build(VLM)
    with pytest.raises(PipelineConfigError, match=message):
        check_pipeline_model(model, parallel, 4, PIPELINE_HOOKS)


def test_routing_under_pp_needs_colocated_encoders_and_sizes_that_fit():
    with torch.device("meta"):
        model = build(VLM)
    assert check_media_routing(model, ParallelConfig(pp=2, encoder_balance=True, encoder_sp=2,
                                                      encoder_sp_threshold=THRESHOLD)) == []
    inline = check_media_routing(model, ParallelConfig(pp=2, encoder_balance=True, encoder_colocate=False))
    assert "set parallel.encoder_colocate=true" in inline[0]
    with pytest.raises(LayoutError, match=r"encoder_sp=4 must divide the 2 ranks .*pp x dp"):
        ParallelDims.resolve(ParallelConfig(pp=2, encoder_sp=4), 2)
    fsdp_message = r"encoder_fsdp=3 must divide the pp x dp ranks .* = 4; pick one of \[1, 2, 4\]"
    with pytest.raises(LayoutError, match=fsdp_message):
        ParallelDims.resolve(ParallelConfig(pp=2, encoder_fsdp=3), 4)
    assert ParallelDims.resolve(ParallelConfig(pp=2, encoder_fsdp=4), 4).encoder_shard_size == 4  # over all ranks
    inline_dims = ParallelDims.resolve(ParallelConfig(pp=2, encoder_colocate=False), 4)
    assert (inline_dims.encoder_span, inline_dims.encoder_shard_size) == (2, 2)  # the first stage's ranks


PIPELINE_OVERRIDES = ("--parallel.pp", "2")
"""All the tiny recipes need: they take two micro-batches per step (1F1B needs one per stage);
their tied embedding and head become one copy on each end stage (``veomni/parallel/pipeline/tied.py``)."""


def test_tiny_vlm_recipe_trains_with_pp2(tmp_path, vqa_build):
    """Through the launcher and the trainer, with the encoder work balanced over the ranks and
    long images (over 16 patches) sequence-parallel; eval and a checkpoint included."""
    from tests.launch.test_launch import train_sh
    from tests.recipes.test_omni_recipes import RECIPES

    out = tmp_path / "out"
    result = train_sh(str(RECIPES / "tiny.yaml"), *PIPELINE_OVERRIDES, "--parallel.encoder_balance", "true",
                      "--parallel.encoder_sp", "2", "--parallel.encoder_sp_threshold", "16",
                      "--data.train_path", str(vqa_build / "train"),
                      "--data.eval_path", str(vqa_build / "eval"),
                      "--train.max_steps", "2", "--train.output_dir", str(out), "--train.eval_interval", "2",
                      "--train.eval_batches", "1", "--checkpoint.interval", "2", "--log.progress_bar", "false",
                      timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 2
    assert any("eval_loss" in r for r in records)
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)


def test_audio_recipe_trains_with_pp2(tmp_path):
    from tests.launch.test_launch import train_sh
    from tests.models.test_audio_modality import REPO
    from veomni.data.builders import load_script

    captions = load_script(REPO / "data" / "build_audio_captions.py")
    captions.build(tmp_path / "train", tmp_path / "eval", seed=1, train_samples=48, eval_samples=8)
    result = train_sh(str(REPO / "recipes" / "audio" / "tiny_audio_caption.yaml"), *PIPELINE_OVERRIDES,
                      "--data.train_path", str(tmp_path / "train"), "--data.eval_path", str(tmp_path / "eval"),
                      "--data.prepare", "null", "--train.max_steps", "2", "--train.eval_interval", "2",
                      "--train.eval_batches", "1", "--train.output_dir", str(tmp_path / "out"),
                      "--checkpoint.interval", "2", timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any("eval_loss" in m for m in metrics)
    assert all(np.isfinite(m["loss"]) for m in metrics if "loss" in m)


def test_pipeline_refusals_say_what_the_recipe_needs(capfd):
    """What a pipeline asks of the recipe, said before any worker starts."""
    from tests.launch.test_launch import dry_run
    from tests.recipes.test_omni_recipes import RECIPES

    result = dry_run(capfd, str(RECIPES / "tiny.yaml"), "--parallel.pp", "2", "--train.grad_accum", "1")
    assert result.returncode != 0 and "raise train.grad_accum" in result.stdout + result.stderr
    result = dry_run(capfd, str(RECIPES / "tiny.yaml"), "--parallel.pp", "2")  # the plan, memory included
    assert result.returncode == 0, result.stderr[-2000:]
    assert "1F1B: 2 stages" in result.stdout + result.stderr
    with torch.device("meta"):  # a tied embedding and head, as the recipes have, is not refused
        check_pipeline_model(build(TINY_OMNI), ParallelConfig(pp=2), 2, PIPELINE_HOOKS)
