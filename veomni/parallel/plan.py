"""Deprecated: ``veomni.parallel.plan`` is now ``veomni.contract.plan``
(the ParallelPlan a model declares; the previous release's path).

Kept for one release so that plug-ins written against that release still run; importing it warns
(``veomni/contract/deprecated.py``).
"""

from veomni.contract.deprecated import moved_module

__getattr__ = moved_module("veomni.parallel.plan", "veomni.contract.plan")
