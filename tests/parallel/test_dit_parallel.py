"""The video DiT under FSDP / HSDP, Ulysses sequence parallelism, context parallelism (ring at
cp=2, Mesh-Attention 2x2 at cp=4: the self-attention runs context-parallel, bidirectional, and
the text cross-attention stays replicated, every rank holding the whole caption) and compile
equals one process.

Rows pack images and clips of different sizes whose tokens straddle the sequence-parallel split
points, with captions of different lengths. Each sample's noise, timestep and caption dropout are
drawn once, for that sample alone, so a row of all samples (one process) and the rows of each
data-parallel rank hold the same diffusion inputs; the loss, every gradient and the parameters
after two SGD steps must agree. Wan2.1 image-to-video (rows of I2V and T2V samples) is checked
under FSDP 2 and SP 2, first-frame conditioning under SP 2.
"""

import pytest
import torch
import torch.distributed as dist

from harness.gloo_ranks import run_distributed
from models.dit.conditioning import wan_i2v_condition
from tests.parity_utils import assert_records_close, full_grads, full_params
from veomni.config.schema import ParallelConfig
from veomni.contract import build_model, get_model_spec, load_plugins
from veomni.ops.video_patch import grid_positions, patch_grid, patchify
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh
from veomni.parallel.row_split import shard_batch
from veomni.train.step import clip_and_step, forward_backward

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

TINY_DIT = dict(num_layers=2, num_attention_heads=4, attention_head_dim=8, ffn_dim=48, in_channels=4,
                out_channels=4, text_dim=12, freq_dim=16, patch_size=[1, 2, 2])
# Wan2.1 I2V's layout: image states through their own cross-attention keys/values, the frame mask
# and first-frame latent as extra input channels (4 + 4 + 4); its rows mix I2V and T2V samples
TINY_I2V = {**TINY_DIT, "in_channels": 12, "image_dim": 10, "added_kv_proj_dim": 32}
# Wan2.2 TI2V-style first-frame conditioning, drawn per sample: rows mix conditioned and plain clips
TINY_FIRST_FRAME = {**TINY_DIT, "first_frame_probability": 0.5}
# (frames, height, width) of latent samples: images (1 frame) and clips, mixed sizes
SHAPES = [[(3, 4, 4), (1, 6, 4), (2, 4, 6)], [(1, 4, 4), (3, 6, 6), (2, 2, 4), (1, 2, 4)]]


def prepared_sample(shape, seed, task, config=TINY_DIT):
    """One sample's row, prepared alone with its own generator (fixed whatever the layout). Under
    an I2V config an even seed is an image-to-video sample (image states, the first frame's latent
    as condition), an odd one a text-to-video sample (no image states, zero condition)."""
    gen = torch.Generator().manual_seed(seed)
    latent = torch.randn(config["out_channels"], *shape, generator=gen)
    text = torch.randn(int(torch.randint(2, 6, (1,), generator=gen)), config["text_dim"], generator=gen)
    patch = tuple(config["patch_size"])
    tokens = patchify(latent, patch)
    grid = patch_grid(latent.shape, patch)
    row = {"latents": tokens, "positions": grid_positions(grid),
           "sample_index": torch.zeros(len(tokens), dtype=torch.long),
           "cu_seqlens": torch.tensor([0, len(tokens)], dtype=torch.int32), "max_seqlen": len(tokens),
           "grid": torch.tensor([grid]), "text_states": text,
           "text_cu_seqlens": torch.tensor([0, len(text)], dtype=torch.int32)}
    if "image_dim" in config:
        first_frame = torch.cat([latent[:, :1], torch.zeros_like(latent[:, 1:])], dim=1)
        row["condition"] = patchify(wan_i2v_condition(first_frame) * (1 - seed % 2), patch)
        row["image_states"] = torch.randn(3 * (1 - seed % 2), config["image_dim"], generator=gen)
        row["image_cu_seqlens"] = torch.tensor([0, len(row["image_states"])], dtype=torch.int32)
    return task.prepare(row, gen)


def concat_rows(rows):
    """Prepared single-sample rows -> one packed row (sample indices renumbered)."""
    fields = ("latents", "positions", "noisy", "target", "clean", "grid", "text_states", "timesteps")
    fields += ("image_states",) if "image_states" in rows[0] else ()
    out = {k: torch.cat([r[k] for r in rows]) for k in fields}
    out["sample_index"] = torch.cat([torch.full((len(r["latents"]),), i) for i, r in enumerate(rows)])
    lengths = torch.tensor([len(r["latents"]) for r in rows])
    text_lengths = torch.tensor([len(r["text_states"]) for r in rows])
    out["cu_seqlens"] = torch.cat([torch.zeros(1), lengths.cumsum(0)]).to(torch.int32)
    out["text_cu_seqlens"] = torch.cat([torch.zeros(1), text_lengths.cumsum(0)]).to(torch.int32)
    if "image_states" in rows[0]:
        image_lengths = torch.tensor([len(r["image_states"]) for r in rows])
        out["image_cu_seqlens"] = torch.cat([torch.zeros(1), image_lengths.cumsum(0)]).to(torch.int32)
    out["max_seqlen"] = int(lengths.max())
    return out


def _randomise(model):
    """Every parameter random (DiTs zero-initialise their output layers, which would hide gradients)."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _run(rank, world, parallel, dp_world, steps=SHAPES, same_samples=False, config=TINY_DIT):
    """``same_samples``: every step draws step 0's samples again (the same shapes and captions)."""
    load_plugins()
    dims = ParallelDims.resolve(parallel, world)
    meshes = build_mesh(dims, "cpu")
    torch.manual_seed(0)
    _, model = build_model("dit", config)
    model.init_weights()
    _randomise(model)
    task = get_model_spec("dit").task(model.config)
    model = parallelize(model, parallel, meshes, "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dp_rank = meshes.dp_rank if dp_world > 1 else 0
    record = {"loss": [], "grads": [], "metrics": []}
    for step, shapes in enumerate(steps):
        rows = [prepared_sample(s, 100 * (0 if same_samples else step) + i, task, config)
                for i, s in enumerate(shapes)]
        batch = concat_rows(rows[dp_rank::dp_world])
        if dims.row_ranks > 1:
            batch = shard_batch(batch, meshes.row_split, task.contract)
        metrics = forward_backward(model, task, [batch], meshes.loss.get_group(), dims.loss_size, dims.row_ranks)
        record["loss"].append(metrics["loss"])
        record["metrics"].append({})
        record["grads"].append(full_grads(model))
        clip_and_step(model, optimizer, None, max_grad_norm=0.0)
    record["params"] = full_params(model)
    dist.barrier()
    return record


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_run, 1, ParallelConfig(), 1)[0]


def test_rows_straddle_the_split():
    totals = [sum(f * (h // 2) * (w // 2) for f, h, w in shapes) for shapes in SHAPES]
    assert any(t % 2 for t in totals), "a row whose length sp=2 does not divide exercises the padding"
    assert all(t % 4 for t in totals), "nor do cp=2's 4 zig-zag chunks (or cp=4's 8) divide any row"


@pytest.mark.parametrize("world, parallel, dp_world", [
    (2, ParallelConfig(dp_shard=2), 2),
    (2, ParallelConfig(sp=2), 1),
    (2, ParallelConfig(sp=2, activation_checkpointing="full"), 1),
    (4, ParallelConfig(sp=2, dp_shard=2), 2),
    (4, ParallelConfig(sp=2, dp_replicate=2), 2),
    (2, ParallelConfig(cp=2, cp_mesh=[1, 2]), 1),
    (4, ParallelConfig(cp=4, cp_mesh=[2, 2]), 1),
], ids=["fsdp2", "sp2", "sp2-ac", "fsdp2xsp2", "hsdp2xsp2", "cp2-ring", "cp4-mesh2x2"])
def test_dit_parallel_matches_single_process(reference, world, parallel, dp_world):
    for got in run_distributed(_run, world, parallel, dp_world):
        assert_records_close(reference, got)


@pytest.fixture(scope="module")
def conditioned_references():
    return {name: run_distributed(_run, 1, ParallelConfig(), 1, SHAPES, False, config)[0]
            for name, config in (("i2v", TINY_I2V), ("first-frame", TINY_FIRST_FRAME))}


@pytest.mark.parametrize("name, config, world, parallel, dp_world", [
    ("i2v", TINY_I2V, 2, ParallelConfig(dp_shard=2), 2),
    ("i2v", TINY_I2V, 2, ParallelConfig(sp=2), 1),
    ("first-frame", TINY_FIRST_FRAME, 2, ParallelConfig(sp=2), 1),
], ids=["i2v-fsdp2", "i2v-sp2", "first-frame-sp2"])
def test_image_conditioned_dit_parallel_matches_single_process(conditioned_references, name, config, world, parallel,
                                                               dp_world):
    """Rows of image- and text-to-video samples. Wan2.1 I2V: image states stay whole-row fields
    (every rank holds the row's), the condition channels run along the row inside ``noisy``.
    First-frame conditioning: ``clean`` runs along the row, the timestep-0 tables are whole-row."""
    for got in run_distributed(_run, world, parallel, dp_world, SHAPES, False, config):
        assert_records_close(conditioned_references[name], got)


def test_compiled_dit_under_fsdp2_matches_one_eager_process(tmp_path):
    """Two steps on the same samples, so each block compiles once (a cold compile costs most of a
    minute on CPU); recompiling for new row lengths is tests/parallel/test_fsdp_parity.py's compile case.
    A private inductor cache, so nothing is left behind."""
    steps = [SHAPES[0], SHAPES[0]]
    reference = run_distributed(_run, 1, ParallelConfig(), 1, steps, True)[0]
    for got in run_distributed(_run, 2, ParallelConfig(dp_shard=2, compile=True), 2, steps, True,
                               env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}):
        assert_records_close(reference, got)
