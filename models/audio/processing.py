"""Waveforms -> log-mel features for the audio encoder (numpy + transformers.audio_utils).

Whisper-style features: a Hann-windowed STFT (``n_fft`` window, ``hop_length`` hop, centred),
power spectrum, Slaney mel filters, ``log10``, the dynamic range clamped to 8 decades below the
clip's peak, then ``(x + 4) / 4`` so values sit around [-1, 1]. One row per hop (10 ms at the
defaults); a clip of ``S`` samples gives ``1 + S // hop_length`` frames.
"""

from __future__ import annotations

import functools
import io
import wave as wav_io

import numpy as np
import torch
from transformers.audio_utils import mel_filter_bank, spectrogram, window_function

from .config import AudioEncoderConfig


@functools.lru_cache(maxsize=8)
def _mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> np.ndarray:
    return mel_filter_bank(
        num_frequency_bins=n_fft // 2 + 1,
        num_mel_filters=n_mels,
        min_frequency=0.0,
        max_frequency=sample_rate / 2,
        sampling_rate=sample_rate,
        norm="slaney",
        mel_scale="slaney",
    )


def num_feature_frames(num_samples: int, hop_length: int = 160) -> int:
    """Frames ``waveform_to_features`` gives for a clip of ``num_samples`` samples."""
    return 1 + num_samples // hop_length


def waveform_to_features(
    wave: np.ndarray | torch.Tensor,
    sample_rate: int,
    n_mels: int = 80,
    n_fft: int = 400,
    hop_length: int = 160,
) -> tuple[torch.Tensor, int]:
    """Mono waveform [samples] in [-1, 1] -> (features float32 [frames, n_mels], frames).

    The mel filters are built for ``sample_rate``; an encoder should see one rate (its config's
    ``sample_rate``), so resample elsewhere when a source differs.
    """
    samples = wave.detach().cpu().numpy() if torch.is_tensor(wave) else np.asarray(wave)
    if samples.ndim != 1:
        raise ValueError(
            f"expected a mono waveform [samples], got shape {samples.shape}; average the channels first"
        )
    if samples.shape[0] <= n_fft // 2:
        raise ValueError(f"a clip needs more than n_fft // 2 = {n_fft // 2} samples, got {samples.shape[0]}")
    power = spectrogram(
        samples.astype(np.float64),
        window_function(n_fft, "hann"),
        frame_length=n_fft,
        hop_length=hop_length,
        power=2.0,
        mel_filters=_mel_filters(sample_rate, n_fft, n_mels),
        log_mel="log10",
        dtype=np.float64,
    )  # [n_mels, frames]
    power = np.maximum(power, power.max() - 8.0)
    features = torch.from_numpy(((power + 4.0) / 4.0).T.astype(np.float32)).contiguous()
    return features, features.shape[0]


def encode_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """Mono float waveform in [-1, 1] -> 16-bit PCM WAV bytes (stdlib ``wave``)."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767).round().astype("<i2")
    buffer = io.BytesIO()
    with wav_io.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())
    return buffer.getvalue()


def decode_wav(data: bytes) -> tuple[np.ndarray, int]:
    """16-bit PCM WAV bytes -> (mono float32 waveform in [-1, 1], sample rate); channels are averaged."""
    with wav_io.open(io.BytesIO(data), "rb") as reader:
        if reader.getsampwidth() != 2:
            raise ValueError(f"only 16-bit PCM WAV is supported, got {8 * reader.getsampwidth()}-bit")
        channels, rate = reader.getnchannels(), reader.getframerate()
        pcm = np.frombuffer(reader.readframes(reader.getnframes()), dtype="<i2")
    samples = pcm.reshape(-1, channels).mean(axis=1) / 32768.0
    return samples.astype(np.float32), rate


def wav_to_features(data: bytes, cfg: AudioEncoderConfig) -> tuple[torch.Tensor, int]:
    """One WAV file's bytes -> ``waveform_to_features`` with the encoder's settings.

    Raises ``ValueError`` when the file's sample rate is not ``cfg.sample_rate`` (resample it
    offline) or the clip is longer than ``cfg.max_frames`` (cut it into shorter clips).
    """
    samples, rate = decode_wav(data)
    if rate != cfg.sample_rate:
        raise ValueError(
            f"audio sampled at {rate} Hz; the encoder expects {cfg.sample_rate} Hz (resample it first)"
        )
    frames = num_feature_frames(samples.shape[0], cfg.hop_length)
    if frames > cfg.max_frames:
        raise ValueError(f"clip of {frames} frames is longer than max_frames={cfg.max_frames}; cut it first")
    return waveform_to_features(samples, rate, cfg.n_mels, cfg.n_fft, cfg.hop_length)
