"""Audio encoder (log-mel -> conv stem -> transformer -> LLM width), a modality encoder for omni models."""

from .config import AudioEncoderConfig
from .model import AudioEncoder
from .processing import decode_wav, encode_wav, num_feature_frames, wav_to_features, waveform_to_features

__all__ = [
    "AudioEncoder",
    "AudioEncoderConfig",
    "decode_wav",
    "encode_wav",
    "num_feature_frames",
    "wav_to_features",
    "waveform_to_features",
]
