"""Worker entry point, started by torchrun from ``scripts/train.sh``:

    python -m veomni.train.run RECIPE.yaml [--section.key VALUE ...]
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from veomni.config.loader import load_config
from veomni.logging_setup import setup_logging
from veomni.train.stop import RunStopped, report_stop
from veomni.train.trainer import Trainer


def main(argv: list[str]) -> int:
    setup_logging()
    cfg = load_config(argv[0], argv[1:])
    try:
        trainer = Trainer(cfg, launch=argv)
        trainer.train()
    except RunStopped as exc:  # every rank raised it at the same point: no barrier needed
        return report_stop(exc)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: gloo occasionally aborts there after success
