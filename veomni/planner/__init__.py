"""The --dry-run planner: per-rank memory, communication and layout of a recipe, computed from sizes alone
before any worker starts (used by ``veomni/launch.py``)."""
