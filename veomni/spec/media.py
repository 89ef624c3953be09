"""Deprecated: ``veomni.spec.media`` is now ``veomni.contract.media``
(the media types of omni models; the previous release's path).

Kept for one release so that plug-ins written against that release still run; importing it warns
(``veomni/contract/deprecated.py``).
"""

from veomni.contract.deprecated import moved_module

__getattr__ = moved_module("veomni.spec.media", "veomni.contract.media")
