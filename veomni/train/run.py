"""Worker entry point, started by torchrun from ``scripts/train.sh``:

    python -m veomni.train.run RECIPE.yaml [--section.key VALUE ...]

An error a restart cannot fix (``veomni.errors.BadInput``, raised where input is checked: bad data,
config or checkpoint) stops the run with its message and no traceback; torchrun restarts the group once
more, and those workers leave at once, before importing torch, on finding the message. A crash
(a dead peer, a collective that failed) prints its traceback and restarts the group.
"""

from __future__ import annotations

import os
import sys
import traceback

from veomni.train.fault.stop import earlier_stop, report_input_error, restart_cannot_fix


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from veomni.config.load import load_config
    from veomni.logging_setup import setup_logging
    from veomni.train.fault.stop import RunStopped, report_stop
    from veomni.train.trainer import Trainer

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


def _run(argv: list[str]) -> int:
    if earlier_stop():  # a worker of this run stopped it; train.sh reports why
        return 0
    try:
        return main(argv)
    except BaseException as exc:  # say why, then leave at once (below)
        if restart_cannot_fix(exc):
            return report_input_error(exc)
        if earlier_stop():  # a peer's collective failed because that worker stopped the run: no crash
            return 0
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    code = _run(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown, after success and after a crash alike: gloo occasionally aborts
    # there, and a process group whose peer died can hang in it, so torchrun would never see this
    # worker fail and never restart the group.
    os._exit(code)
