"""Every field of PEFT's ``LoraConfig``, judged: honoured both ways, irrelevant to what the adapters
compute, or refused by name with what to do instead.

A PEFT folder made with an option our LoRA does not compute (DoRA, trained biases, activated
LoRA...) must not load as plain LoRA and give other logits in silence; and a field a newer peft
adds, with a value that is not off, is refused as unknown rather than ignored. The launcher's check
(``veomni/checkpoint/lora_checks.py``) and ``load_peft`` call ``peft_config_problems``, so a
refusal comes before any worker starts. docs/lora.md has the table in words;
``tests/adapters/test_peft_options.py`` checks it covers every field of the installed peft.
"""

from __future__ import annotations

from typing import Any

# Compared with the recipe or read on import, and written on export (peft_io.py).
HONOURED = {
    "peft_type": "must be LORA; written LORA",
    "r": "equals lora.rank",
    "lora_alpha": "equals lora.alpha",
    "use_rslora": "equals lora.rslora",
    "rank_pattern": "equals lora.rank_pattern, layer by layer",
    "alpha_pattern": "equals lora.alpha_pattern, layer by layer",
    "target_modules": "the folder's adapters equal the layers lora.targets selects (list or regex alike: "
                      "judged by the adapters the folder holds); written as the full list of names",
    "target_parameters": "grouped experts' adapters, as target_modules",
    "exclude_modules": "judged by the adapters the folder holds, as target_modules",
    "layers_to_transform": "judged by the adapters the folder holds, as target_modules",
    "layers_pattern": "judged by the adapters the folder holds, as target_modules",
    "modules_to_save": "the modules of lora.train, trained whole: loaded into them, and written from them",
    "bias": "'none' (no adapter bias) is ours; other values are refused",
}
# Metadata, or what only PEFT's training or memory use reads: no effect on the adapters' output.
IRRELEVANT = {
    "task_type": "which PEFT wrapper class to build; written CAUSAL_LM (null for a diffusers model)",
    "auto_mapping": "metadata", "peft_version": "metadata", "revision": "metadata", "inference_mode": "metadata",
    "base_model_name_or_path": "metadata; written as the export's base (see 'The base of a PEFT folder')",
    "lora_dropout": "training only; the run uses lora.dropout, and the export writes it",
    "fan_in_fan_out": "how a GPT-2 Conv1D base stores its weight; the adapters' layout is the same",
    "init_lora_weights": "the start of a fresh PEFT adapter; the folder's trained values are loaded "
                         "(the inits that change the base weights are refused)",
    "loftq_config": "init only (init_lora_weights judges it)", "eva_config": "init only",
    "corda_config": "init only", "lora_ga_config": "init only",
    "qalora_group_size": "read only with use_qalora", "megatron_core": "read only with megatron_config",
    "runtime_config": "run-time settings (offloading), not the adapters",
    "velora_config": "a training-memory variant: compressed activations in the backward only",
    "ensure_weight_tying": "ties PEFT's copies of tied weights; our tied weight is one tensor",
}
_MERGE = ("merge it into its base with peft (PeftModel.from_pretrained(base, folder).merge_and_unload()"
          ".save_pretrained(dir)) and start from that folder with checkpoint.init_from_hf, without "
          "lora.init_from_peft")
# Set to anything but off, these change what the adapters compute, or the base they apply to.
REFUSED = {
    "use_dora": "DoRA's magnitude vectors are not computed by our LoRA",
    "lora_bias": "an adapter bias on lora_B is not computed by our LoRA",
    "alora_invocation_tokens": "activated LoRA applies the adapters only after the invocation tokens",
    "use_qalora": "QA-LoRA pools the adapter's input for a quantized base",
    "monteclora_config": "Monte Carlo LoRA samples the adapters",
    "layer_replication": "it repeats base layers, a model of another depth",
    "trainable_token_indices": "it trains rows of the embedding apart from it",
    "megatron_config": "the adapters were made for Megatron-core parallel layers",
    "use_bdlora": "block-diagonal LoRA factors are not computed by our LoRA",
    "arrow_config": "Arrow routes among several adapters",
    "kasa_config": "KaSA truncates the base weight's singular values and adds a learned diagonal",
}
# init_lora_weights values that only draw the adapters' start; the others (PiSSA, OLoRA, CorDA,
# LoftQ, LoRA-GA, and any new one) subtract their start from the base weights, so the folder
# belongs to a changed base unless peft converted it (path_initial_model_for_weight_conversion).
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")


def _off(value: Any) -> bool:
    return not value  # None, False, 0, "", [], {}: PEFT's "not used"


def peft_config_problems(config: dict[str, Any], folder: str) -> list[str]:
    """What of a PEFT folder's ``adapter_config.json`` our LoRA cannot load as it is, one line per
    field, naming it and what to do."""
    problems = []
    for name, value in config.items():
        if name in HONOURED or name in IRRELEVANT:
            continue
        if name in REFUSED:
            reason = REFUSED[name]
        else:
            reason = "veomni does not know this field (a newer peft?), so it cannot tell what it changes"
        if not _off(value):
            problems.append(f"{folder}: {name}={value!r}: {reason}; {_MERGE}")
    if config.get("bias", "none") != "none":
        problems.append(f"{folder}: bias={config['bias']!r}: the folder trains biases, our LoRA trains none; "
                        f"{_MERGE}, or retrain with bias='none'")
    init = config.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        problems.append(f"{folder}: init_lora_weights={init!r} changes the base weights at the start, so the "
                        "adapters belong to that changed base; save the adapter with peft's "
                        f"path_initial_model_for_weight_conversion (a plain LoRA on the original base), or {_MERGE}")
    return problems
