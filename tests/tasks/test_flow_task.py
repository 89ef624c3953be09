"""The diffusion task's conventions, checked against diffusers' schedulers and by construction."""

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler

from veomni.tasks.base import task_generator
from veomni.tasks.flow import DiffusionTask, euler_flow_step, guided, resolution_shift, sample_sigmas, shift_sigmas


def packed_row(lengths=(12, 4, 20), patch_dim=8, text_lengths=(3, 5, 2), text_dim=6, pad=0):
    """A row in the flow contract's layout: samples of ``lengths`` tokens, then ``pad`` padding tokens."""
    total = sum(lengths)
    sample_index = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((pad,), -1)])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    text_cu = torch.tensor([0, *torch.tensor(text_lengths).cumsum(0).tolist()], dtype=torch.int32)
    latents = torch.randn(total + pad, patch_dim)
    latents[total:] = 0
    return {"latents": latents, "positions": torch.zeros(total + pad, 3, dtype=torch.long),
            "sample_index": sample_index, "cu_seqlens": cu, "max_seqlen": max(lengths),
            "text_states": torch.randn(int(text_cu[-1]), text_dim), "text_cu_seqlens": text_cu}


def per_token(values, batch):
    return values[batch["sample_index"].clamp(min=0)][:, None]


def test_rectified_flow_interpolates_data_to_noise_and_targets_the_velocity():
    torch.manual_seed(0)
    batch = packed_row()
    out = DiffusionTask(text_dropout=0.0).prepare(batch, torch.Generator().manual_seed(1))
    t = per_token(out["timesteps"] / 1000, batch)
    noise = out["target"] + batch["latents"]  # velocity = noise - data
    torch.testing.assert_close(out["noisy"], (1 - t) * batch["latents"] + t * noise)
    # d x_t / d t of x_t = (1 - t) x0 + t eps is eps - x0: the target
    torch.testing.assert_close((out["noisy"] - batch["latents"]) / t, out["target"], rtol=1e-4, atol=1e-4)
    assert 0 < float(out["timesteps"].min()) and float(out["timesteps"].max()) < 1000


def test_flow_noise_matches_diffusers_scale_noise():
    """diffusers' FlowMatchEulerDiscreteScheduler.scale_noise is x_t = sigma eps + (1 - sigma) x0."""
    torch.manual_seed(0)
    batch = packed_row(lengths=(16,), text_lengths=(4,))
    out = DiffusionTask(text_dropout=0.0).prepare(batch, torch.Generator().manual_seed(3))
    sigma = float(out["timesteps"][0]) / 1000
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000)
    scheduler.set_timesteps(sigmas=[sigma, 0.0])  # pins its sigma table to ours
    reference = scheduler.scale_noise(batch["latents"], scheduler.timesteps[:1], out["target"] + batch["latents"])
    torch.testing.assert_close(out["noisy"], reference, rtol=1e-5, atol=1e-5)


def test_shift_and_euler_step_match_diffusers():
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    base = torch.linspace(1, 1000, 1000).flip(0) / 1000
    torch.testing.assert_close(shift_sigmas(base.double(), 3.0).float(), scheduler.sigmas.float())
    steps, shift = 6, 2.5
    ours = sample_sigmas(steps, shift)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 0.0, steps + 1)[:-1].tolist())
    torch.testing.assert_close(ours.float(), scheduler.sigmas.float(), rtol=1e-6, atol=1e-6)
    x, v = torch.randn(4, 5), torch.randn(4, 5)
    reference = scheduler.step(v, scheduler.timesteps[0], x).prev_sample
    torch.testing.assert_close(euler_flow_step(x, v, float(ours[0]), float(ours[1])), reference)


def test_euler_sampler_of_the_exact_velocity_lands_on_the_data():
    """For a single data point x0, the exact flow velocity at x_t is (x_t - x0) / t: the sampler
    must end at x0 whatever the schedule."""
    x0 = torch.randn(3, 4)
    sigmas = sample_sigmas(7, 3.0)
    x = torch.randn(3, 4)
    for sigma, nxt in zip(sigmas[:-1].tolist(), sigmas[1:].tolist()):
        x = euler_flow_step(x, (x - x0) / sigma, sigma, nxt)
    torch.testing.assert_close(x, x0)
    c, u = torch.randn(5), torch.randn(5)
    torch.testing.assert_close(guided(c, u, 1.0), c)
    torch.testing.assert_close(guided(c, u, 3.0), u + 3 * (c - u))


def test_resolution_shift_puts_more_noise_on_larger_samples():
    assert resolution_shift(torch.tensor([256]), 1.0, 256).item() == pytest.approx(1.0)
    assert resolution_shift(torch.tensor([1024]), 1.0, 256).item() == pytest.approx(2.0)
    big, small = packed_row(lengths=(64,), text_lengths=(2,)), packed_row(lengths=(4,), text_lengths=(2,))
    task = DiffusionTask(shift=1.0, shift_base_tokens=16, text_dropout=0.0)
    t_big = task.prepare(big, torch.Generator().manual_seed(5))["timesteps"]
    t_small = task.prepare(small, torch.Generator().manual_seed(5))["timesteps"]  # same z drawn
    assert float(t_big) > float(t_small)


def test_ddpm_noise_matches_diffusers_add_noise_and_targets_epsilon():
    torch.manual_seed(0)
    batch = packed_row()
    out = DiffusionTask(objective="ddpm", text_dropout=0.0).prepare(batch, torch.Generator().manual_seed(2))
    scheduler = DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2")
    steps = out["timesteps"].long()
    reference = scheduler.add_noise(batch["latents"], out["target"], steps[batch["sample_index"]])
    torch.testing.assert_close(out["noisy"], reference, rtol=1e-5, atol=1e-5)


def test_text_dropout_zeroes_whole_captions_at_the_configured_rate():
    batch = packed_row(lengths=(2,) * 400, text_lengths=(3,) * 400)
    out = DiffusionTask(text_dropout=0.25).prepare(batch, torch.Generator().manual_seed(0))
    per_caption = out["text_states"].view(400, 3, -1)
    dropped = (per_caption == 0).flatten(1).all(1)
    kept = (per_caption == batch["text_states"].view(400, 3, -1)).flatten(1).all(1)
    assert bool((dropped | kept).all())
    assert 0.18 < dropped.float().mean().item() < 0.32


def test_draws_follow_the_generator_and_padding_carries_no_loss():
    batch = packed_row(pad=5)
    task = DiffusionTask()
    first = task.prepare(batch, task_generator(0, 7, 0, dp_rank=0))
    again = task.prepare(batch, task_generator(0, 7, 0, dp_rank=0))
    other = task.prepare(batch, task_generator(0, 7, 0, dp_rank=1))
    torch.testing.assert_close(first["noisy"], again["noisy"], rtol=0, atol=0)
    assert not torch.equal(first["noisy"], other["noisy"])
    assert task.count_loss_units(first) == 36  # real tokens; the loss is their per-element mean
    assert bool((first["noisy"][36:] == 0).all()) and bool((first["target"][36:] == 0).all())

    def predict_zero_except_padding(noisy, batch):
        return torch.where(batch["sample_index"][:, None] >= 0, torch.zeros_like(noisy), torch.full_like(noisy, 9.0))

    loss = task(predict_zero_except_padding, first)
    torch.testing.assert_close(loss.loss_sum, (first["target"][:36] ** 2).sum() / 8)


def test_baseline_is_the_variance_of_the_targets():
    batch = DiffusionTask().prepare(packed_row(), torch.Generator().manual_seed(0))
    task = DiffusionTask()
    baseline = task.baseline_loss(task.baseline_stats(batch))
    assert baseline.loss == pytest.approx(batch["target"].double().var(unbiased=False).item(), rel=1e-6)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="objective"):
        DiffusionTask(objective="edm")
    with pytest.raises(ValueError, match="text_dropout"):
        DiffusionTask(text_dropout=1.0)
