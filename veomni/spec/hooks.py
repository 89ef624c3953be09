"""Deprecated: ``veomni.spec.hooks`` is now ``veomni.contract.hooks``
(the typed hooks a model implements; the previous release's path).

Kept for one release so that plug-ins written against that release still run; importing it warns
(``veomni/contract/deprecated.py``).
"""

from veomni.contract.deprecated import moved_module

__getattr__ = moved_module("veomni.spec.hooks", "veomni.contract.hooks")
