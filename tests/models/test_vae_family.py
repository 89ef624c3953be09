"""The ``vae`` family against diffusers' ``AutoencoderKL``, its export, the reconstruction task's
loss normalisation and baseline, the ``frames`` dataset kind, and FSDP at 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from diffusers import AutoencoderKL

import models  # noqa: F401  (registers the vae family)
from harness.gloo_ranks import run_distributed
from models.vae.hf_adapter import VAEAdapter
from tests.clip_shards import write_clip_shards
from tests.parity_utils import assert_grads_parity, assert_parity, assert_scalar_parity, assert_series_parity
from veomni.checkpoint.manager import COMPLETE_MARKER
from veomni.config.load import dump_config
from veomni.config.schema import DataConfig, ModelConfig, ParallelConfig, RunConfig
from veomni.contract import build_model, get_model_spec
from veomni.data.build_loader import build_dataloader
from veomni.data.builders import load_script
from veomni.data.kinds import DatasetRequest
from veomni.data.video.frames import FramesDataset

BUILDER = Path(__file__).resolve().parents[2] / "data" / "build_vae.py"
TINY = dict(block_out_channels=[8, 16], norm_num_groups=4, latent_channels=4, layers_per_block=1, sample_size=16)


def tiny_vae(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    with torch.device("meta"):
        config, model = build_model("vae", {**TINY, **overrides})
    model.to_empty(device="cpu")
    model.init_weights()
    return config, model


def reference_vae(config, seed: int) -> AutoencoderKL:
    """A diffusers AutoencoderKL of ``config`` with every parameter random (not its init)."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(**config.diffusers_config())
    with torch.no_grad():
        for param in vae.parameters():
            param.normal_(0, 0.1)
    return vae.eval()


def images(count: int, size: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.rand(count, 3, size, size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def test_wrapper_equals_diffusers_autoencoder_kl():
    config, model = tiny_vae()
    reference = reference_vae(config, seed=5)
    adapter = VAEAdapter()
    model.load_state_dict(adapter.state_dict_from_hf(reference.state_dict(), config))
    x = images(3)
    with torch.no_grad():
        expected = reference(x, sample_posterior=False).sample
        posterior = reference.encode(x).latent_dist
        model.eval()
        got, kl = model(x, {"images": x})
    assert_parity(got, expected, "got")
    assert_parity(kl, posterior.kl(), "kl")

    # Training decodes the posterior sample: the task's noise plays diffusers' generator's part.
    task = get_model_spec("vae").task(config)
    batch = task.prepare({"images": x}, torch.Generator().manual_seed(7))
    with torch.no_grad():
        sampled = reference(x, sample_posterior=True, generator=torch.Generator().manual_seed(7)).sample
        model.train()
        got, _ = model(x, batch)
    assert_parity(got, sampled, "got")


def test_init_weights_fills_every_parameter_from_the_seed():
    _, first = tiny_vae(seed=3)
    _, again = tiny_vae(seed=3)
    _, other = tiny_vae(seed=4)
    for (name, a), b in zip(first.state_dict().items(), again.state_dict().values()):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    weights = [n for n, p in first.named_parameters() if p.dim() > 1]
    assert all(not torch.equal(first.state_dict()[n], other.state_dict()[n]) for n in weights)


def test_exported_folder_reloads_in_diffusers(tmp_path):
    config, model = tiny_vae(seed=2)
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step_00000001"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(checkpoint))
    (checkpoint / COMPLETE_MARKER).write_text("{}")
    (run / "config.yaml").write_text(dump_config(RunConfig(model=ModelConfig(arch="vae", options=dict(TINY)))))

    load_script(BUILDER).export_checkpoint(checkpoint, tmp_path / "vae")
    reloaded = AutoencoderKL.from_pretrained(tmp_path / "vae").eval()
    assert json.loads((tmp_path / "vae" / "config.json").read_text())["_class_name"] == "AutoencoderKL"
    x = images(2)
    model.eval()
    with torch.no_grad():
        assert_parity(reloaded(x).sample, model(x, {"images": x})[0], "reloaded(x).sample")
    adapter = VAEAdapter()
    assert adapter.config_from_hf(dict(reloaded.config)) == config


def test_loss_normalisation_is_independent_of_the_micro_batch_split():
    config, model = tiny_vae(kl_weight=1e-2)
    task = get_model_spec("vae").task(config)
    batch = task.prepare({"images": images(8)}, torch.Generator().manual_seed(0))

    def mean_loss_and_grads(pieces):
        model.zero_grad()
        outs = [task(model, {k: v[s] for k, v in batch.items()}) for s in pieces]
        units = sum(o.loss_units for o in outs)
        loss = sum(o.loss_sum for o in outs) / units
        loss.backward()
        return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}

    whole_loss, whole_grads = mean_loss_and_grads([slice(0, 8)])
    split_loss, split_grads = mean_loss_and_grads([slice(0, 3), slice(3, 8)])
    assert_scalar_parity(split_loss, whole_loss, "loss")
    assert_grads_parity(split_grads, whole_grads, "micro-batch split")
    out = task(model, batch)
    assert out.loss_units == 8 * 3 * 16 * 16
    recon, kl = (float(out.metrics[k][0]) for k in ("loss_recon", "loss_kl"))
    assert recon + kl == pytest.approx(float(out.loss_sum), rel=1e-6)


@pytest.mark.parametrize("reconstruction", ["l1", "l2"])
def test_baseline_is_the_error_of_the_mean_colour(reconstruction):
    config, _ = tiny_vae(reconstruction=reconstruction)
    task = get_model_spec("vae").task(config)
    levels = torch.randint(0, 256, (6, 3, 16, 16), generator=torch.Generator().manual_seed(0))
    batches = [{"images": levels[:2] / 127.5 - 1}, {"images": levels[2:] / 127.5 - 1}]
    baseline = task.baseline_loss(sum(task.baseline_stats(b) for b in batches))
    pixels = (levels / 127.5 - 1).double()
    error = pixels - pixels.mean(dim=(0, 2, 3), keepdim=True)
    expected = error.abs().mean() if reconstruction == "l1" else error.pow(2).mean()
    assert baseline.loss == pytest.approx(float(expected), rel=1e-6)  # the images are float32


def frames_dataset(path: Path, split: str, dp_rank: int = 0, dp_size: int = 1, batch: int = 4) -> FramesDataset:
    config, _ = tiny_vae()
    cfg = DataConfig(train_path=str(path), eval_path=str(path), tokens_per_micro_batch=batch, max_bad_fraction=0.5)
    return FramesDataset(DatasetRequest(cfg, str(path), split, None, dp_rank, dp_size, 0, config))


def take(iterator, count):
    return [next(iterator)["images"] for _ in range(count)]


def test_frames_resume_is_exact_and_corrupt_clips_are_skipped(tmp_path):
    clips = write_clip_shards(tmp_path / "clips", clips=18, shards=2, seed=0, corrupt=3)
    dataset = frames_dataset(clips, "train")
    stream = iter(dataset)
    take(stream, 2)
    state = dataset.state_dict()
    expected = take(stream, 6)  # crosses into the second epoch (18 good clips / 4 per batch)
    assert dataset.skipped == 3  # the whole first epoch was read: its 3 corrupt clips, counted once

    resumed = frames_dataset(clips, "train")
    resumed.load_state_dict(state)
    for want, got in zip(expected, take(iter(resumed), 6)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    first = expected[0]
    assert first.shape == (4, 3, 16, 16) and first.min() >= -1 and first.max() <= 1


def test_frames_ranks_read_disjoint_clips(tmp_path):
    clips = write_clip_shards(tmp_path / "clips", clips=21, shards=3, seed=1, corrupt=2)
    per_rank = []
    for rank in range(2):
        dataset = frames_dataset(clips, "eval", rank, 2, batch=5)
        per_rank.append((torch.cat([batch["images"] for batch in dataset]), dataset.skipped))
    assert sum(len(images) for images, _ in per_rank) == 21
    assert sum(skipped for _, skipped in per_rank) == 2
    first, second = (images.flatten(1) for images, _ in per_rank)
    assert not (first[:, None] == second[None]).all(-1).any()  # no clip went to both ranks


def test_frames_loader_builds_from_the_registry(tmp_path):
    clips = write_clip_shards(tmp_path / "clips", clips=6, shards=1)
    config, _ = tiny_vae()
    loader = build_dataloader(DataConfig(train_path=str(clips), tokens_per_micro_batch=3), "train", None, 0, 1, 0,
                              config, kind="frames")
    assert next(iter(loader))["images"].shape == (3, 3, 16, 16)


STEPS, IMAGES_PER_STEP = 2, 6


def _train(rank, world):
    from tests.parity_utils import full_params
    from veomni.parallel.apply import parallelize
    from veomni.parallel.mesh import ParallelDims, build_mesh
    from veomni.train.step import clip_and_step, forward_backward

    meshes = build_mesh(ParallelDims.resolve(ParallelConfig(), world), "cpu")
    config, model = tiny_vae(seed=0, kl_weight=1e-3)
    task = get_model_spec("vae").task(config)
    model = parallelize(model, ParallelConfig(), meshes, "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        batch = task.prepare({"images": images(IMAGES_PER_STEP, seed=step)}, torch.Generator().manual_seed(step))
        mine = {k: v[rank::world] for k, v in batch.items()}  # 3 images per rank at 2 ranks
        metrics = forward_backward(model, task, [mine], meshes.loss.get_group(), world)
        losses.append((metrics["loss"], metrics["loss_recon"], metrics["loss_kl"]))
        clip_and_step(model, optimizer, None, max_grad_norm=0.0)
    return losses, full_params(model)


def test_fsdp_two_ranks_equal_one_process():
    (ref_losses, ref_params), = run_distributed(_train, 1)
    for losses, params in run_distributed(_train, 2):
        for step, (got, want) in enumerate(zip(losses, ref_losses)):  # loss, its recon and KL terms
            assert_series_parity(got, want, f"step {step} loss, recon, kl")
        for name, value in ref_params.items():
            assert_parity(params[name], value, f"param {name}")
