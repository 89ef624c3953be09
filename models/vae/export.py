"""Export a ``vae`` checkpoint as a diffusers ``AutoencoderKL`` folder:

    python -m models.vae.export OUTPUT_DIR/checkpoints/step_N EXPORT_DIR [--config RUN/config.yaml]

Why not ``scripts/export_hf.sh``: the engine's export writes transformers folders
(``model.safetensors``); a diffusers folder needs diffusers' file names, so the family builds the
``AutoencoderKL`` and lets diffusers' ``save_pretrained`` write it. The weights come through the
engine's ``load_checkpoint_weights`` (any world size or FSDP layout wrote them). The folder is
written aside and renamed into place, so a crash never leaves a half export.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from diffusers import AutoencoderKL

from veomni.checkpoint.export import load_checkpoint_weights

from .hf_adapter import VAEAdapter


def build_diffusers_vae(state_dict, config) -> AutoencoderKL:
    """An ``AutoencoderKL`` of ``config`` holding ``state_dict`` (our names, full tensors)."""
    adapter = VAEAdapter()
    hf_config = {k: v for k, v in adapter.config_to_hf(config).items() if not k.startswith("_")}
    vae = AutoencoderKL(**hf_config)
    vae.load_state_dict(adapter.state_dict_to_hf(state_dict, config), strict=True)
    return vae.eval()


def save_atomically(vae: AutoencoderKL, out: Path) -> Path:
    """``vae.save_pretrained`` into a hidden sibling of ``out``, then renamed into place."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        vae.save_pretrained(tmp, safe_serialization=True)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export(checkpoint: Path, out: Path, config_path: Path | None = None) -> AutoencoderKL:
    """Load ``checkpoint`` (a ``vae`` run's ``step_*`` folder) and write it to ``out``; returns the VAE."""
    run_cfg, model_cfg, state_dict = load_checkpoint_weights(checkpoint, config_path)
    if run_cfg.model.arch != "vae":
        raise ValueError(f"{checkpoint} is a {run_cfg.model.arch!r} checkpoint, not a 'vae' one")
    vae = build_diffusers_vae(state_dict, model_cfg)
    save_atomically(vae, out)
    return vae


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--config", type=Path, default=None, help="run config (default: OUTPUT_DIR/config.yaml)")
    args = parser.parse_args(argv)
    try:
        export(args.checkpoint, args.out_dir, args.config)
    except (FileNotFoundError, ValueError) as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
