"""Deprecated: ``veomni.data.registry`` is now ``veomni.data.kinds``
(the registry of dataset kinds; the previous release's path).

Kept for one release so that plug-ins written against that release still run; importing it warns
(``veomni/contract/deprecated.py``).
"""

from veomni.contract.deprecated import moved_module

__getattr__ = moved_module("veomni.data.registry", "veomni.data.kinds")
