"""Export a LoRA run: its adapters as a PEFT folder, or the merged model as a Hugging Face /
diffusers folder.

    python -m veomni.adapters.export RUN_DIR --peft OUT        # adapter_config.json + adapter_model.safetensors
    python -m veomni.adapters.export RUN_DIR --merged OUT      # config.json + safetensors (+ tokenizer)

A LoRA checkpoint holds only what trains, so the base is rebuilt as the run built it: the run's
seed, the family's init and the pretrained folders of ``checkpoint.init_from_hf`` / ``init``
(recorded in the checkpoint as its ``frozen_base``, which must match the run's ``config.yaml``).
Runs in one process without a process group, like ``veomni.checkpoint.export``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from veomni.adapters.lora import adapted_model, is_adapter_name, merge_lora
from veomni.adapters.peft_io import export_peft, frozen_base, init_adapters
from veomni.checkpoint.component_init import init_entries, load_components
from veomni.checkpoint.export import newest_checkpoint
from veomni.checkpoint.hf_io import save_hf_pretrained
from veomni.checkpoint.manager import COMPLETE_MARKER
from veomni.config.load import load_config
from veomni.config.schema import RunConfig
from veomni.contract import build_config, get_model_spec, load_plugins
from veomni.logging_setup import setup_logging

logger = logging.getLogger(__name__)


def load_lora_run(checkpoint: Path, config_path: Path) -> tuple[RunConfig, object, nn.Module]:
    """(run config, model config, the adapted CPU model holding the checkpoint's trained values)."""
    run_cfg = load_config(config_path)
    if run_cfg.lora.rank <= 0:
        raise ValueError(f"{config_path} is not a LoRA run (lora.rank is 0): export it with "
                         "scripts/export_hf.sh")
    meta = json.loads((checkpoint / COMPLETE_MARKER).read_text())
    if meta.get("frozen_base") != frozen_base(run_cfg):
        raise ValueError(f"{checkpoint} was trained on the base {meta.get('frozen_base')}, but {config_path} "
                         f"describes {frozen_base(run_cfg)}: pass the run's own config.yaml with --config")
    load_plugins(run_cfg.model.plugins)
    spec = get_model_spec(run_cfg.model.arch)
    model_cfg = build_config(run_cfg.model.arch, run_cfg.model.options)
    torch.manual_seed(run_cfg.train.seed)  # the base exactly as the run's rank 0 built it
    model = adapted_model(functools.partial(spec.instantiate, model_cfg), run_cfg.lora)
    model.init_weights()
    load_components(model, init_entries(run_cfg.checkpoint), is_adapter_name)
    init_adapters(model, run_cfg.lora, spec.hf_adapter, model_cfg, resuming=True)
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    state = {"model": trained}
    dcp.load(state, checkpoint_id=str(checkpoint))
    model.load_state_dict(state["model"], strict=False)
    logger.info("%s: %d trained tensors over the rebuilt base", checkpoint, len(state["model"]))
    return run_cfg, model_cfg, model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="veomni.adapters.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's train.output_dir")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a step_* folder (default: the newest)")
    parser.add_argument("--config", type=Path, default=None, help="run config (default: RUN_DIR/config.yaml)")
    parser.add_argument("--peft", type=Path, default=None, help="write the adapters as a PEFT folder here")
    parser.add_argument("--merged", type=Path, default=None, help="write the merged model as a HF folder here")
    parser.add_argument("--base-model", default="", help="base_model_name_or_path recorded in the PEFT config")
    args = parser.parse_args(argv)
    setup_logging()
    if args.peft is None and args.merged is None:
        parser.error("nothing to do: pass --peft OUT and/or --merged OUT")
    try:
        checkpoint = args.checkpoint or newest_checkpoint(args.run_dir)
        run_cfg, model_cfg, model = load_lora_run(checkpoint, args.config or args.run_dir / "config.yaml")
        spec = get_model_spec(run_cfg.model.arch)
        if spec.hf_adapter is None:
            raise ValueError(f"model {run_cfg.model.arch!r} has no Hugging Face adapter to name PEFT modules")
        if args.peft is not None:
            export_peft(model, spec.hf_adapter, model_cfg, run_cfg.lora, args.peft, args.base_model)
            logger.info("adapters of %s -> %s (PEFT)", checkpoint, args.peft)
        if args.merged is not None:
            tokenizer = Path(run_cfg.data.tokenizer) if run_cfg.data.tokenizer else None
            save_hf_pretrained(run_cfg.model.arch, model_cfg, merge_lora(model.state_dict(), model), args.merged,
                               tokenizer_dir=tokenizer)
            logger.info("merged model of %s -> %s", checkpoint, args.merged)
    except (FileNotFoundError, ValueError) as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
