"""Audio encoder: log-mel features, packing equals per-clip runs, clips stay separate, FLOPs,
init and config errors (fp32, tiny dims)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models.audio import (
    AudioEncoder,
    AudioEncoderConfig,
    decode_wav,
    encode_wav,
    wav_to_features,
    waveform_to_features,
)
from tests.parity_utils import assert_parity
from veomni.contract.plan import match_modules

LENGTHS = [13, 7, 20, 1, 9]  # frames; 1 and odd lengths exercise the ceil of each stride


def tiny_config(**overrides) -> AudioEncoderConfig:
    base = dict(
        n_mels=16,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        intermediate_size=64,
        out_hidden_size=24,
        init_std=0.1,
    )
    return AudioEncoderConfig(**{**base, **overrides})


def tiny_model(**overrides) -> AudioEncoder:
    torch.manual_seed(0)
    model = AudioEncoder(tiny_config(**overrides))
    model.init_weights()
    with torch.no_grad():  # non-zero biases: the padded conv stem must not leak them across clips
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.3)
    return model


def clips(lengths=LENGTHS, n_mels: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, n_mels, generator=gen) for n in lengths]


def _tone(freq_hz: float, seconds: float, rate: int = 16000) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return 0.5 * np.sin(2 * np.pi * freq_hz * t)


def test_features_have_documented_shape_and_follow_pitch() -> None:
    features, frames = waveform_to_features(_tone(440.0, 1.0), 16000)
    assert features.shape == (frames, 80) == (1 + 16000 // 160, 80) and features.dtype == torch.float32
    again, _ = waveform_to_features(torch.from_numpy(_tone(440.0, 1.0)), 16000)
    assert torch.equal(features, again)  # deterministic; numpy and torch input agree
    low = waveform_to_features(_tone(200.0, 0.5), 16000)[0].mean(0).argmax()
    high = waveform_to_features(_tone(2000.0, 0.5), 16000)[0].mean(0).argmax()
    assert low < high  # the loudest mel bin moves up with the pitch
    assert features.max() - features.min() <= 2.0 + 1e-6  # 8 decades of range, scaled by 1/4


def test_features_reject_bad_waveforms() -> None:
    with pytest.raises(ValueError, match="mono"):
        waveform_to_features(np.zeros((2, 1000)), 16000)
    with pytest.raises(ValueError, match="samples"):
        waveform_to_features(np.zeros(100), 16000)


def test_wav_round_trip_is_within_16_bit_rounding() -> None:
    wave = _tone(300.0, 0.2)
    decoded, rate = decode_wav(encode_wav(wave, 16000))
    assert rate == 16000 and decoded.shape == wave.shape
    assert np.abs(decoded - wave).max() < 2 / 32768


def test_wav_to_features_uses_the_encoder_settings_and_limits() -> None:
    cfg = AudioEncoderConfig(n_mels=40, max_frames=60)
    data = encode_wav(_tone(500.0, 0.5), 16000)
    features, frames = wav_to_features(data, cfg)
    samples, _ = decode_wav(data)
    assert torch.equal(features, waveform_to_features(samples, 16000, n_mels=40)[0]) and frames == 51
    with pytest.raises(ValueError, match="8000 Hz"):
        wav_to_features(encode_wav(_tone(500.0, 0.5, rate=8000), 8000), cfg)
    with pytest.raises(ValueError, match="max_frames=60"):
        wav_to_features(encode_wav(_tone(500.0, 0.7), 16000), cfg)


@pytest.mark.parametrize("strides", [(2, 2), (1, 2), (1, 1)])
def test_packed_clips_equal_each_clip_alone(strides) -> None:
    model = tiny_model(conv_strides=strides)
    parts = clips()
    lengths = torch.tensor(LENGTHS)
    packed = model(torch.cat(parts), lengths)
    counts = model.num_output_tokens(lengths).tolist()
    factor = strides[0] * strides[1]
    assert counts == [math.ceil(math.ceil(n / strides[0]) / strides[1]) for n in LENGTHS]
    assert packed.shape == (sum(counts), 24) and sum(counts) >= sum(LENGTHS) // factor
    for got, part in zip(packed.split(counts), parts):
        assert_parity(got, model(part, torch.tensor([part.shape[0]])), "got")


def test_perturbing_one_clip_changes_only_its_tokens() -> None:
    model = tiny_model()
    parts = clips()
    counts = model.num_output_tokens(torch.tensor(LENGTHS)).tolist()
    before = model(torch.cat(parts), torch.tensor(LENGTHS)).split(counts)
    parts[2] = parts[2] + torch.randn_like(parts[2])
    after = model(torch.cat(parts), torch.tensor(LENGTHS)).split(counts)
    for index, (a, b) in enumerate(zip(before, after)):
        if index == 2:
            assert (a - b).abs().max() > 1e-3
        else:
            assert_parity(a, b, "a")


def test_gradients_reach_every_parameter() -> None:
    model = tiny_model()
    features = torch.cat(clips()).requires_grad_()
    model(features, torch.tensor(LENGTHS)).square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().max() > 0, name
    assert features.grad.abs().max() > 0


def _naive_attention(q, k, v, seq) -> torch.Tensor:
    out = []
    for a, b in itertools.pairwise(seq.cu_seqlens.tolist()):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        weights = torch.softmax(qs @ ks.transpose(1, 2) / qs.shape[-1] ** 0.5, dim=-1)
        out.append((weights @ vs).transpose(0, 1))
    return torch.cat(out)


def test_training_flops_match_flop_counter() -> None:
    """Equal clip lengths, so the padded stem computes no padding the count leaves out."""
    model = tiny_model()
    lengths = torch.tensor([12, 12, 12])
    features = torch.cat(clips([12, 12, 12]))
    fast = model(features, lengths)
    for _, module in match_modules(model, model.parallel_plan().attention):
        module.attn_fn = _naive_attention
    assert_parity(model(features, lengths), fast, "model(features, lengths)")
    features.requires_grad_()
    with FlopCounterMode(display=False) as counter:
        model(features, lengths).sum().backward()
    assert counter.get_total_flops() == model.training_flops(lengths)


def test_init_is_deterministic_and_meta_build_matches() -> None:
    cfg = tiny_config()
    eager = AudioEncoder(cfg)
    torch.manual_seed(5)
    eager.init_weights()
    with torch.device("meta"):
        deferred = AudioEncoder(cfg)
    deferred.to_empty(device="cpu")
    torch.manual_seed(5)
    deferred.init_weights()
    for (name, a), b in zip(eager.state_dict().items(), deferred.state_dict().values()):
        assert torch.equal(a, b), name
    assert [n for n, _ in match_modules(eager, eager.parallel_plan().blocks)] == ["blocks.0", "blocks.1"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(hidden_size=30, num_heads=4), "divisible by num_heads"),
        (dict(hidden_size=36, num_heads=4), "even"),
        (dict(conv_strides=(2, 3)), "conv_strides"),
        (dict(hidden_act="tanh"), "hidden_act"),
        (dict(hop_length=500), "hop_length"),
        (dict(n_mels=0), "n_mels"),
    ],
)
def test_config_errors_name_the_field(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides).validate()


def test_forward_rejects_inconsistent_lengths() -> None:
    model = tiny_model()
    with pytest.raises(ValueError, match=r"features must be \[30, 16\]"):
        model(torch.randn(29, 16), torch.tensor([10, 20]))
    with pytest.raises(ValueError, match="positive frame counts"):
        model(torch.randn(10, 16), torch.tensor([10, 0]))
