"""Input the user must fix, as a type of its own.

A run's failures are of two kinds. Bad input (a recipe value the schema or the model refuses, data
whose records or shards cannot be read, a checkpoint or pretrained folder that does not fit the
model) fails the same way on every try: the run stops once, with one line that says what to fix,
and is never restarted (``veomni.train.fault.stop``). Everything else (a bug, a dead peer, a
failed collective) keeps its traceback and restarts the worker group, where a restart can help.

So the split is made where input is checked, by raising one of the classes below, and not by the
built-in type of an error: a ``ValueError`` a bug raises keeps its traceback. Each class keeps the
built-in base callers catch (``ValueError``, ``FileNotFoundError``), so ``except ValueError`` still
catches a bad recipe value.
"""

from __future__ import annotations


class BadInput(Exception):
    """Input the user must fix; a restart would read it again. The message says what and how."""


class BadConfig(BadInput, ValueError):
    """A recipe value the schema, the layout or the model family refuses."""


class BadData(BadInput, ValueError):
    """Data that cannot be read as the recipe says: a bad shard, record or tokenizer."""


class BadCheckpoint(BadInput, ValueError):
    """A checkpoint or pretrained folder that does not fit this run's model."""


class MissingInput(BadInput, FileNotFoundError):
    """A file or folder the recipe names is not there."""
