"""The range and cross-field rules of a loaded recipe that the field types alone cannot express
(``train.lr > 0``, ``data.max_seq_len <= model.max_position_embeddings``, ...), each refusal
naming the recipe line the value came from. Kept apart from ``load.py``, which reads, merges
and types the YAML, so that adding a rule touches only this list."""

from __future__ import annotations

from veomni.config.schema import RunConfig
from veomni.config.types import ConfigError


def check_ranges(cfg: RunConfig, origins: dict[str, str]) -> None:
    """Cross-field and range rules the types alone cannot express."""

    def where(*key: str) -> str:
        dotted = ".".join(key)
        return f"{origins[dotted]}: {dotted}" if dotted in origins else f"{dotted} (default)"

    rules = [
        (cfg.train.max_steps >= 1, ("train", "max_steps"), "must be >= 1"),
        (cfg.train.grad_accum >= 1, ("train", "grad_accum"), "must be >= 1"),
        (cfg.train.lr > 0, ("train", "lr"), "must be > 0"),
        (0 <= cfg.train.min_lr_ratio <= 1, ("train", "min_lr_ratio"), "must be in [0, 1]"),
        (cfg.train.warmup_steps >= 0, ("train", "warmup_steps"), "must be >= 0"),
        (cfg.train.max_grad_norm >= 0, ("train", "max_grad_norm"), "must be >= 0 (0 disables clipping)"),
        (cfg.train.eval_batches >= 0, ("train", "eval_batches"), "must be >= 0 (0: the whole held-out set)"),
        (cfg.train.max_restarts >= 0, ("train", "max_restarts"), "must be >= 0 (0: a dead worker ends the run)"),
        (cfg.train.collective_timeout_s > 0, ("train", "collective_timeout_s"), "must be > 0 seconds"),
        (cfg.train.straggler_factor == 0 or cfg.train.straggler_factor > 1, ("train", "straggler_factor"),
         "must be > 1 (a multiple of the median step time), or 0 to turn the check off"),
        (cfg.train.straggler_window >= 1, ("train", "straggler_window"), "must be >= 1"),
        (cfg.train.shared_fs_timeout_s > 0, ("train", "shared_fs_timeout_s"), "must be > 0 seconds"),
        (cfg.train.loss_spike_factor == 0 or cfg.train.loss_spike_factor > 1, ("train", "loss_spike_factor"),
         "must be > 1 (a multiple of the running mean loss), or 0 to skip only non-finite steps"),
        (cfg.train.loss_spike_window >= 1, ("train", "loss_spike_window"), "must be >= 1"),
        (cfg.train.max_bad_steps >= 1, ("train", "max_bad_steps"), "must be >= 1"),
        (cfg.preference.beta > 0, ("preference", "beta"), "must be > 0"),
        (0 <= cfg.preference.label_smoothing < 0.5, ("preference", "label_smoothing"), "must be in [0, 0.5)"),
        (cfg.preference.rpo_alpha >= 0, ("preference", "rpo_alpha"), "must be >= 0 (0: no NLL term)"),
        (cfg.rl.group_size >= 2, ("rl", "group_size"), "must be >= 2 (a group's rewards normalise its advantages)"),
        (cfg.rl.max_new_tokens >= 1, ("rl", "max_new_tokens"), "must be >= 1"),
        (cfg.rl.temperature > 0, ("rl", "temperature"), "must be > 0 (rollouts sample)"),
        (0 < cfg.rl.top_p <= 1, ("rl", "top_p"), "must be in (0, 1]"),
        (cfg.rl.top_k >= 0, ("rl", "top_k"), "must be >= 0 (0: no cut)"),
        (cfg.rl.updates_per_rollout >= 1, ("rl", "updates_per_rollout"), "must be >= 1"),
        (0 <= cfg.rl.clip_low < 1, ("rl", "clip_low"), "must be in [0, 1)"),
        (cfg.rl.clip_high >= 0, ("rl", "clip_high"), "must be >= 0"),
        (cfg.rl.kl_coef >= 0, ("rl", "kl_coef"), "must be >= 0"),
        (0 < cfg.rl.rollout_engine_memory < 1, ("rl", "rollout_engine_memory"), "must be in (0, 1)"),
        (not cfg.rl.reward_weights or len(cfg.rl.reward_weights) == len(cfg.rl.rewards), ("rl", "reward_weights"),
         "must give one weight per entry of rl.rewards (or be empty: all 1)"),
        (cfg.checkpoint.keep_last >= 1, ("checkpoint", "keep_last"), "must be >= 1"),
        (cfg.checkpoint.interval >= 0, ("checkpoint", "interval"), "must be >= 0 (0 saves at the end only)"),
        (cfg.data.num_workers >= 0, ("data", "num_workers"), "must be >= 0"),
        (0 <= cfg.data.max_bad_fraction <= 1, ("data", "max_bad_fraction"), "must be in [0, 1]"),
        (cfg.data.tokens_per_micro_batch >= 1, ("data", "tokens_per_micro_batch"), "must be >= 1"),
        (cfg.data.max_seq_len >= 1, ("data", "max_seq_len"), "must be >= 1 (the longest sample, in the task's units)"),
        (cfg.data.shuffle_window >= 1, ("data", "shuffle_window"), "must be >= 1 (1 keeps the read order)"),
        (cfg.data.balance_group >= 0, ("data", "balance_group"), "must be >= 0 (0: the ranks of one node)"),
        (cfg.data.balance_max_wait >= 1, ("data", "balance_max_wait"), "must be >= 1 step"),
        (cfg.lora.rank >= 0, ("lora", "rank"), "must be >= 0 (0: no adapters, the whole model trains)"),
    ]
    lora_keys = [key for key in ("targets", "train", "init_from_peft") if getattr(cfg.lora, key)]
    if cfg.lora.rank == 0 and lora_keys:  # rank 0 would train the whole model, silently
        rules.append((False, ("lora", lora_keys[0]),
                      "is set but lora.rank is 0, which turns LoRA off and trains the whole model: set lora.rank "
                      "> 0 (e.g. 8) to train adapters, or remove the lora section to train the whole model"))
    max_positions = cfg.model.options.get("max_position_embeddings")
    if max_positions is not None:
        rules.append((cfg.data.max_seq_len <= max_positions, ("data", "max_seq_len"),
                      f"({cfg.data.max_seq_len}) exceeds model.max_position_embeddings ({max_positions})"))
    for ok, key, message in rules:
        if not ok:
            raise ConfigError(f"{where(*key)} {message}")
