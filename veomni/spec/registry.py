"""Deprecated: ``veomni.spec.registry`` is now ``veomni.contract.families``
(the registry of model families; the previous release's path).

Kept for one release so that plug-ins written against that release still run; importing it warns
(``veomni/contract/deprecated.py``).
"""

from veomni.contract.deprecated import moved_module

__getattr__ = moved_module("veomni.spec.registry", "veomni.contract.families")
