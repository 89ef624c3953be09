"""Entry point of ``scripts/sample.sh``: the zoo's sampler (``models/dit/sample.py``) with the
engine's checkpoint reader, which the zoo may not import itself."""

import sys

from models.dit.sample import main
from veomni.checkpoint.export import load_run_weights

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], load_run_weights))
