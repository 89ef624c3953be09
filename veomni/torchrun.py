"""``torchrun``, with a signal to it ending as a requested stop does: no traceback.

``scripts/train.sh`` starts the workers through this module instead of the ``torchrun`` command.
A scheduler that signals every process of a job (Slurm's ``scancel``, a pod's termination) also
signals torchrun itself: its elastic agent then sends the signal on to the workers, which finish
their step, checkpoint, print how to resume and the summary (``veomni/train/fault/stop.py``),
waits for them, and re-raises the signal as a ``SignalException`` whose traceback would end the
output. Here it ends with one line and the conventional status 128 + the signal's number.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun_main


def main() -> int:
    try:
        torchrun_main()
    except SignalException as exc:
        print(f"[torchrun] {exc.sigval.name} received: the workers were asked to stop (each finishes its step, "
              "checkpoints and summarises, as printed above); signal scripts/train.sh itself for exit status 0",
              file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
