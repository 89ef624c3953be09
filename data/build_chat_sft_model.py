"""Build the chat SFT model that the DPO recipe starts from, so that recipe runs with its one command.

``recipes/preference/tiny_chat_dpo.yaml`` starts from the model ``recipes/chat/tiny_chat_sft.yaml``
trains, as a Hugging Face folder (``checkpoint.init_from_hf``). The launcher runs this script
(``checkpoint.prepare``) when that folder is missing: it trains the SFT recipe into the folder's
parent unless that run already holds a complete checkpoint (yours, if you ran it), then exports the
newest complete checkpoint there with ``scripts/export_hf.sh``.

    python data/build_chat_sft_model.py --out outputs/tiny_chat_sft/hf
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the Hugging Face folder to write")
    args = parser.parse_args(argv)
    run = args.out.resolve().parent
    if newest_checkpoint(run) is None:
        print(f"[build_chat_sft_model] training {SFT_RECIPE.relative_to(REPO)} into {run} first", flush=True)
        subprocess.run(["bash", str(REPO / "scripts" / "train.sh"), str(SFT_RECIPE), "--train.output_dir", str(run)],
                       check=True)
    checkpoint = newest_checkpoint(run)
    if checkpoint is None:
        raise SystemExit(f"{run} holds no complete checkpoint after the SFT run")
    print(f"[build_chat_sft_model] exporting {checkpoint} to {args.out}", flush=True)
    subprocess.run(["bash", str(REPO / "scripts" / "export_hf.sh"), str(checkpoint), str(args.out)], check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
