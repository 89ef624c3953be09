"""What a user most likely meant by an unknown recipe key.

Spelling slips (``max_step``) are caught by ``difflib``; names carried over from other frameworks
(``learning_rate``, ``fsdp_size``, ``gradient_accumulation_steps``, Hugging Face config names) are
not, and the nearest spelling is then wrong (``parallel.fsdp`` is closest to ``parallel.sp``). So a
small table of such names, pointing at our key wherever it lives, is consulted first.
"""

from __future__ import annotations

import difflib
import typing

from veomni.config.schema import RunConfig

ALIASES = {
    # optimizer and schedule (transformers' TrainingArguments, Megatron, Lightning)
    "learning_rate": "train.lr",
    "max_lr": "train.lr",
    "max_train_steps": "train.max_steps",
    "total_steps": "train.max_steps",
    "train_steps": "train.max_steps",
    "max_iters": "train.max_steps",
    "num_steps": "train.max_steps",
    "num_warmup_steps": "train.warmup_steps",
    "warmup_iters": "train.warmup_steps",
    "warmup": "train.warmup_steps",
    "gradient_accumulation_steps": "train.grad_accum",
    "accumulate_grad_batches": "train.grad_accum",
    "grad_accumulation_steps": "train.grad_accum",
    "gradient_accumulation": "train.grad_accum",
    "max_norm": "train.max_grad_norm",
    "grad_clip": "train.max_grad_norm",
    "clip_grad": "train.max_grad_norm",
    "clip_grad_norm": "train.max_grad_norm",
    "gradient_clipping": "train.max_grad_norm",
    "eval_steps": "train.eval_interval",
    "save_dir": "train.output_dir",
    # batches and sequences: this framework batches by tokens (dynamic batch size)
    "batch_size": "data.tokens_per_micro_batch",
    "micro_batch_size": "data.tokens_per_micro_batch",
    "train_batch_size": "data.tokens_per_micro_batch",
    "per_device_train_batch_size": "data.tokens_per_micro_batch",
    "global_batch_size": "data.tokens_per_micro_batch",
    "max_tokens": "data.tokens_per_micro_batch",
    "seq_len": "data.max_seq_len",
    "seq_length": "data.max_seq_len",
    "max_seq_length": "data.max_seq_len",
    "max_length": "data.max_seq_len",
    "context_length": "data.max_seq_len",
    "block_size": "data.max_seq_len",
    "data_path": "data.train_path",
    "train_file": "data.train_path",
    "train_data": "data.train_path",
    "dataset": "data.train_path",
    "tokenizer_path": "data.tokenizer",
    "tokenizer_name_or_path": "data.tokenizer",
    # parallelism (torchtitan, Megatron, DeepSpeed, accelerate names)
    "fsdp": "parallel.dp_shard",
    "fsdp_size": "parallel.dp_shard",
    "data_parallel_shard_degree": "parallel.dp_shard",
    "dp": "parallel.dp_shard",
    "dp_size": "parallel.dp_shard",
    "data_parallel_size": "parallel.dp_shard",
    "ddp": "parallel.dp_replicate",
    "data_parallel_replicate_degree": "parallel.dp_replicate",
    "sp_size": "parallel.sp",
    "ulysses_size": "parallel.sp",
    "sequence_parallel_size": "parallel.sp",
    "ulysses_parallel_size": "parallel.sp",
    "cp_size": "parallel.cp",
    "context_parallel_size": "parallel.cp",
    "context_parallel_degree": "parallel.cp",
    "ep_size": "parallel.ep",
    "expert_parallel_size": "parallel.ep",
    "expert_parallel_degree": "parallel.ep",
    "pp_size": "parallel.pp",
    "pipeline_parallel_size": "parallel.pp",
    "pipeline_parallel_degree": "parallel.pp",
    "gradient_checkpointing": "parallel.activation_checkpointing",
    "activation_checkpoint": "parallel.activation_checkpointing",
    "recompute": "parallel.activation_checkpointing",
    "precision": "parallel.mixed_precision",
    "dtype": "parallel.mixed_precision",
    "bf16": "parallel.mixed_precision",
    # checkpoints
    "save_steps": "checkpoint.interval",
    "save_interval": "checkpoint.interval",
    "checkpoint_interval": "checkpoint.interval",
    "save_total_limit": "checkpoint.keep_last",
    "resume_from_checkpoint": "checkpoint.resume",
    "model_name_or_path": "checkpoint.init_from_hf",
    "pretrained_model_name_or_path": "checkpoint.init_from_hf",
    "pretrained": "checkpoint.init_from_hf",
    "load_path": "checkpoint.init_from_hf",
    # logging
    "logging_steps": "log.interval",
    "log_interval": "log.interval",
    "log_every": "log.interval",
    # Hugging Face config names of the decoder LM's fields
    "num_hidden_layers": "model.num_layers",
    "n_layers": "model.num_layers",
    "num_attention_heads": "model.num_heads",
    "n_heads": "model.num_heads",
    "num_key_value_heads": "model.num_kv_heads",
    "n_kv_heads": "model.num_kv_heads",
    "tie_word_embeddings": "model.tie_embeddings",
    "num_local_experts": "model.num_experts",
    "n_routed_experts": "model.num_experts",
}
"""Names from other frameworks -> our dotted key. A ``model.`` target is offered only when the
recipe's model arch has that field."""

NOT_OFFERED = {
    name: "tensor parallelism is not a recipe of this framework: shard parameters with parallel.dp_shard "
          "(FSDP), split sequences with parallel.sp or parallel.cp, experts with parallel.ep, layers with "
          "parallel.pp"
    for name in ("tp", "tp_size", "tensor_parallel_size", "tensor_model_parallel_size", "tensor_parallel_degree")
}


def _closed_sections() -> list[str]:
    return [name for name in typing.get_type_hints(RunConfig) if name != "model"]


def _section_fields(section: str) -> list[str]:
    section_types = typing.get_type_hints(RunConfig)
    return list(typing.get_type_hints(section_types[section])) if section in section_types else []


def suggest(key: str, valid: list[str], section: str = "") -> str:
    """The hint to append to "unknown key '<section>.<key>'" (or, without a section, to "unknown
    section"): the alias's key, else the same key in the section it belongs to, else the closest
    spelling among ``valid`` (the keys of ``section``), else the list of valid keys."""
    prefix = f"{section}." if section else ""
    if key in NOT_OFFERED:
        return f"; {NOT_OFFERED[key]}"
    target = ALIASES.get(key.lower()) if section else None
    if target is not None:
        target_section, _, field = target.partition(".")
        if target_section == section:
            known = valid
        else:  # the model's fields depend on its arch: only offered from inside the model section
            known = [] if target_section == "model" else _section_fields(target_section)
        if field in known:
            return f"; did you mean '{target}'?"
    elsewhere = [other for other in _closed_sections() if other != section and key in _section_fields(other)]
    if section and elsewhere:
        return f"; did you mean '{elsewhere[0]}.{key}'? (it belongs to the {elsewhere[0]} section)"
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if match:
        return f"; did you mean '{prefix}{match[0]}'?"
    return f"; valid keys: {', '.join(prefix + v for v in sorted(valid))}"
