"""Build the SFT model that a preference recipe starts from, so that recipe runs with its one command.

``recipes/preference/tiny_chat_dpo.yaml`` starts from the model ``recipes/chat/tiny_chat_sft.yaml``
trains (the default ``--recipe``), ``recipes/preference/tiny_vqa_dpo.yaml`` from the one
``recipes/qwen2.5-vl/tiny.yaml`` trains (``checkpoint.prepare_args: [--recipe, ...]``, a path from
the repository's root), each as a Hugging Face folder (``checkpoint.init_from_hf``). The launcher
runs this script (``checkpoint.prepare``) when that folder is missing: it trains the SFT recipe
into the folder's parent unless that run already holds a complete checkpoint (yours, if you ran
it), then exports the newest complete checkpoint there with ``scripts/export_hf.sh`` (``--step N``:
the checkpoint of step N instead; ``recipes/rl/tiny_chat_grpo.yaml`` starts from the half-trained
step 150, which still gets sorting wrong often enough for RL to have something to fix).

    python data/build_chat_sft_model.py --out outputs/tiny_chat_sft/hf
    python data/build_chat_sft_model.py --out outputs/qwen2.5_vl_tiny/hf --recipe recipes/qwen2.5-vl/tiny.yaml
    python data/build_chat_sft_model.py --out outputs/tiny_chat_sft/hf_step150 --step 150
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SFT_RECIPE = REPO / "recipes" / "chat" / "tiny_chat_sft.yaml"
COMPLETE = "complete.json"  # veomni.checkpoint.manager.COMPLETE_MARKER: the checkpoint was published whole


def newest_checkpoint(run: Path) -> Path | None:
    """The newest complete checkpoint of the run in ``run`` (None if it has none)."""
    found = sorted(marker.parent for marker in (run / "checkpoints").glob(f"step_*/{COMPLETE}"))
    return found[-1] if found else None


def chosen_checkpoint(run: Path, step: int | None) -> Path | None:
    """The complete checkpoint of ``step`` in ``run`` (None: the newest); None if it has none."""
    if step is None:
        return newest_checkpoint(run)
    checkpoint = run / "checkpoints" / f"step_{step:08d}"
    return checkpoint if (checkpoint / COMPLETE).is_file() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face folder to write")
    parser.add_argument("--recipe", type=Path, default=SFT_RECIPE.relative_to(REPO),
                        help="the SFT recipe to train, from the repository's root (default: %(default)s)")
    parser.add_argument("--step", type=int, help="export the checkpoint of this step (default: the newest)")
    args = parser.parse_args(argv)
    run = args.out.resolve().parent
    if newest_checkpoint(run) is None:
        print(f"[build_chat_sft_model] training {args.recipe} into {run} first", flush=True)
        subprocess.run(["bash", str(REPO / "scripts" / "train.sh"), str(REPO / args.recipe), "--train.output_dir",
                        str(run)], check=True)
    checkpoint = chosen_checkpoint(run, args.step)
    if checkpoint is None:
        raise SystemExit(f"{run} holds no complete checkpoint {'' if args.step is None else f'of step {args.step} '}"
                         "after the SFT run (the SFT recipe's checkpoint.interval and keep_last decide which stay)")
    print(f"[build_chat_sft_model] exporting {checkpoint} to {args.out}", flush=True)
    subprocess.run(["bash", str(REPO / "scripts" / "export_hf.sh"), str(checkpoint), str(args.out)], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
