"""The diffusion task a DiT trains and samples with, from its config's training fields."""

from veomni.tasks import DiffusionTask

from .config import DiTConfig


def diffusion_task(config: DiTConfig) -> DiffusionTask:
    return DiffusionTask(objective=config.objective, logit_mean=config.logit_mean, logit_std=config.logit_std,
                         shift=config.shift, shift_base_tokens=config.shift_base_tokens,
                         text_dropout=config.text_dropout, first_frame_probability=config.first_frame_probability)
