"""Export a training checkpoint to a Hugging Face folder (config.json + safetensors + tokenizer).

    bash scripts/export_hf.sh OUTPUT_DIR/checkpoints/step_00001000 EXPORT_DIR

Runs in one process without a process group: DCP reads the sharded checkpoint whatever world
size or FSDP layout wrote it. The model config comes from the run's resolved
``config.yaml`` (two folders up from the checkpoint), unless ``--config`` names another.
The result loads with ``transformers.AutoModelForCausalLM.from_pretrained(EXPORT_DIR)``. A LoRA
run's checkpoint is exported merged into its base (``lora_run.py`` rebuilds it); ``--peft DIR``
writes its adapters as a PEFT folder too, naming its base in ``base_model_name_or_path``: the
run's ``checkpoint.init_from_hf`` folder when that alone is the base, else the rebuilt base
(the seeded init, per-part folders), written to ``DIR/base``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from veomni.adapters.lora import is_adapter_name, merge_lora
from veomni.adapters.peft_io import export_peft
from veomni.checkpoint.component_init import WHOLE_MODEL, init_entries
from veomni.checkpoint.hf_io import save_hf_pretrained
from veomni.checkpoint.lora_run import load_lora_checkpoint, rebuild_lora_base
from veomni.checkpoint.manager import COMPLETE_MARKER, EMA_APP_KEY, list_checkpoints
from veomni.config.load import load_config
from veomni.config.schema import RunConfig
from veomni.contract import build_model, get_model_spec
from veomni.logging_setup import setup_logging

logger = logging.getLogger(__name__)




def load_checkpoint_weights(checkpoint: Path, config_path: Path | None = None, prefer_ema: bool = False):
    """``(run config, model config, full state dict)`` of a checkpoint, on CPU. With ``prefer_ema``
    the entries the checkpoint has an EMA of are the EMA's (the rest, e.g. buffers, the model's). A
    LoRA run's (``checkpoint/lora_run.py``) come merged: what the plain model loads."""
    if not (checkpoint / COMPLETE_MARKER).is_file():
        raise FileNotFoundError(f"{checkpoint} is not a complete checkpoint (no {COMPLETE_MARKER})")
    config_path = config_path or checkpoint.parent.parent / "config.yaml"
    if not config_path.is_file():
        raise FileNotFoundError(f"run config not found at {config_path}; pass --config RUN/config.yaml")
    run_cfg = load_config(config_path)
    if run_cfg.lora.rank > 0:  # the adapters folded into the base their run rebuilds
        model_cfg, model = load_lora_checkpoint(checkpoint, run_cfg, ema_entries(checkpoint) if prefer_ema else set())
        return run_cfg, model_cfg, merge_lora(model.state_dict(), model)
    with torch.device("meta"):
        model_cfg, model = build_model(run_cfg.model.arch, run_cfg.model.options)
    model.to_empty(device="cpu")
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(checkpoint))
    weights = state["model"]
    averaged = ema_entries(checkpoint) if prefer_ema else set()
    if averaged:
        ema = {"app": {EMA_APP_KEY: {name: weights[name] for name in averaged if name in weights}}}
        dcp.load(ema, checkpoint_id=str(checkpoint))
        logger.info("%s: %d of %d entries from the EMA weights", checkpoint, len(ema["app"][EMA_APP_KEY]),
                    len(weights))
    return run_cfg, model_cfg, weights


def ema_entries(checkpoint: Path) -> set[str]:
    """Names of the model entries a checkpoint holds an EMA of (empty when it has none)."""
    prefix = f"app.{EMA_APP_KEY}."
    keys = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key[len(prefix):] for key in keys if key.startswith(prefix)}


def newest_checkpoint(run_dir: Path) -> Path:
    """The newest complete ``step_*`` checkpoint of a run (its ``train.output_dir``)."""
    found = list_checkpoints(run_dir / "checkpoints")
    if not found:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir / 'checkpoints'}; is {run_dir} a run's "
                                "train.output_dir?")
    return found[-1][1]


def load_run_weights(run_dir: Path, checkpoint: Path | None = None, prefer_ema: bool = True):
    """``(run config, model config, state dict, checkpoint)`` of a run's newest complete checkpoint
    (or ``checkpoint``), with its EMA weights when it has them and ``prefer_ema``: what sampling uses."""
    checkpoint = checkpoint or newest_checkpoint(run_dir)
    run_cfg, model_cfg, weights = load_checkpoint_weights(checkpoint, run_dir / "config.yaml", prefer_ema)
    return run_cfg, model_cfg, weights, checkpoint


def export_adapters(checkpoint: Path, out_dir: Path, config_path: Path | None = None) -> Path:
    """A LoRA run's adapters as a PEFT folder (``peft.PeftModel.from_pretrained`` loads it)."""
    run_cfg = load_config(config_path or checkpoint.parent.parent / "config.yaml")
    spec = get_model_spec(run_cfg.model.arch)
    if run_cfg.lora.rank <= 0 or spec.hf_adapter is None:
        raise ValueError(f"--peft needs a LoRA run of a family with a Hugging Face adapter; {checkpoint}'s run has "
                         f"lora.rank {run_cfg.lora.rank} and model {run_cfg.model.arch!r}")
    model_cfg, model = load_lora_checkpoint(checkpoint, run_cfg)
    diffusers = isinstance(spec.hf_adapter.config_to_hf(model_cfg), Mapping)  # a diffusers config.json
    export_peft(model, spec.hf_adapter, model_cfg, run_cfg.lora, out_dir, base_model=export_base(run_cfg, out_dir),
                task_type=None if diffusers else "CAUSAL_LM")
    logger.info("exported the adapters of %s -> %s (PEFT)", checkpoint, out_dir)
    return out_dir


def export_base(run_cfg: RunConfig, out_dir: Path) -> str:
    """The base a LoRA run's PEFT folder applies to, as ``base_model_name_or_path``: the run's
    ``checkpoint.init_from_hf`` folder when it alone loads the base; else the base rebuilt from the
    recipe (a seeded random init, folders per part) written as a Hugging Face folder to
    ``out_dir/base``, the lora.train modules at their start (PEFT's ``modules_to_save`` replace them)."""
    entries = init_entries(run_cfg.checkpoint)
    if list(entries) == [WHOLE_MODEL]:
        return str(Path(entries[WHOLE_MODEL]).resolve())
    model_cfg, model = rebuild_lora_base(run_cfg)
    base = {k: v for k, v in model.state_dict().items() if not is_adapter_name(k)}
    tokenizer = Path(run_cfg.data.tokenizer) if run_cfg.data.tokenizer else None
    folder = save_hf_pretrained(run_cfg.model.arch, model_cfg, base, out_dir / "base", tokenizer_dir=tokenizer)
    logger.info("the base of %s is no single pretrained folder: written to %s", out_dir, folder)
    return str(folder.resolve())


def export(checkpoint: Path, out_dir: Path, config_path: Path | None = None, with_tokenizer: bool = True) -> Path:
    """The model as a Hugging Face / diffusers folder (a LoRA run's merged into its base)."""
    run_cfg, model_cfg, state_dict = load_checkpoint_weights(checkpoint, config_path)
    tokenizer = Path(run_cfg.data.tokenizer) if with_tokenizer and run_cfg.data.tokenizer else None
    save_hf_pretrained(run_cfg.model.arch, model_cfg, state_dict, out_dir, tokenizer_dir=tokenizer)
    logger.info("exported %s -> %s (model %s%s)", checkpoint, out_dir, run_cfg.model.arch,
                ", with tokenizer" if tokenizer else "")
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="export_hf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a step_* folder under OUTPUT_DIR/checkpoints")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--config", type=Path, default=None, help="run config (default: OUTPUT_DIR/config.yaml)")
    parser.add_argument("--no-tokenizer", action="store_true", help="do not copy the tokenizer files")
    parser.add_argument("--peft", type=Path, default=None,
                        help="a LoRA run: also write its adapters as a PEFT folder here")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        export(args.checkpoint, args.out_dir, args.config, not args.no_tokenizer)
        if args.peft is not None:
            export_adapters(args.checkpoint, args.peft, args.config)
    except (FileNotFoundError, ValueError) as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
