"""What the tests and the benchmark scripts share: real gloo ranks forked in-process, tiny models with
one training micro-batch per family, synthetic media bytes. Tests (``tests/``) and ``scripts/`` import
from here; neither imports the other, and nothing under ``veomni/`` or ``models/`` imports this."""
