"""Every test sees the zoo registered, as a recipe with the default ``model.plugins`` does; the
recipe tests of the tiny VLM share one small VQA build (``vqa_build``).

Two tiers (docs/testing.md, "Tiers and the time budget"): a test module marked
``pytestmark = pytest.mark.full`` (whole training runs through ``scripts/train.sh``, multi-rank
trainer runs, recipe checks) belongs to the full tier; everything else (unit and parity tests) is
the fast tier a developer runs with ``bash scripts/test.sh --fast``. The end of every run prints
each tier's time against its budget, so a slow newcomer shows up in the run that added it.

A skip is expected only of GPU-only tests (marked ``cuda``) on a machine without one. Any other skip
(a module skipped on a missing package, a test that skips itself) is counted in the run's closing line
as "skipped outside the GPU-only tests" and listed with its reason; with ``VEOMNI_STRICT_SKIPS=1``
(``scripts/test.sh`` sets it unless told otherwise) it fails the run, so a test that proves interop
cannot vanish unnoticed (issue 47)."""

import os
from collections import defaultdict
from pathlib import Path

import pytest

from tests.omni_utils import build_vqa
from veomni.contract import load_plugins

load_plugins()

BUDGET_S = {"fast": 300, "full": 1200 - 300}
"""Seconds on an idle 2-core machine: the fast tier, and the rest of the whole suite's 20 minutes."""

_spent: dict[str, float] = defaultdict(float)
_counted: dict[str, int] = defaultdict(int)
_stray_skips: list[pytest.TestReport | pytest.CollectReport] = []
STRAY_SKIPS = "skipped outside the GPU-only tests"
"""The closing line's name for skips of anything but ``cuda``-marked tests."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: the full tier (whole runs, multi-rank trainers, recipes); "
                                       "bash scripts/test.sh --fast leaves it out")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = "full" if "full" in report.keywords else "fast"
    _spent[tier] += report.duration
    if report.when == "call":
        _counted[tier] += 1
    if report.skipped and "cuda" not in report.keywords:
        _stray_skips.append(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a whole module skipped at import (``pytest.importorskip``, a module-level skip)
        _stray_skips.append(report)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def _strict_skips() -> bool:
    return os.environ.get("VEOMNI_STRICT_SKIPS", "0") == "1"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _stray_skips and _strict_skips() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    lines = [f"{tier} tier: {_counted[tier]} tests, {_spent[tier]:.0f} s (budget {BUDGET_S[tier]} s on an idle "
             f"2-core machine{'; over it: see docs/testing.md' if _spent[tier] > BUDGET_S[tier] else ''})"
             for tier in BUDGET_S if _counted[tier]]
    if lines:
        terminalreporter.write_sep("-", "test tiers")
        for line in lines:
            terminalreporter.write_line(line)
    if _stray_skips:
        terminalreporter.stats[STRAY_SKIPS] = list(_stray_skips)  # counted in the closing line
        terminalreporter.write_sep("-", STRAY_SKIPS + (" (VEOMNI_STRICT_SKIPS=1: the run fails)"
                                                       if _strict_skips() else ""))
        for report in _stray_skips:
            terminalreporter.write_line(f"{report.nodeid}: {_skip_reason(report)}")


@pytest.fixture(scope="session")
def vqa_build(tmp_path_factory) -> Path:
    """A VQA build of 400 training and 40 held-out samples (``data/build_vqa.py``): ``train/``, ``eval/``."""
    folder = tmp_path_factory.mktemp("vqa")
    build_vqa(folder, 400, 40)
    return folder
