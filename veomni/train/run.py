"""Worker entry point, started by torchrun from ``scripts/train.sh``:

    python -m veomni.train.run RECIPE.yaml [--section.key VALUE ...]
"""

from __future__ import annotations

import os
import sys
import traceback

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
    try:
        code = main(sys.argv[1:])
    except BaseException:  # a crash: say where, then leave at once (below)
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown, after success and after a crash alike: gloo occasionally aborts
    # there, and a process group whose peer died can hang in it, so torchrun would never see this
    # worker fail and never restart the group.
    os._exit(code)
