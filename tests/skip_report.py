"""A pytest plugin: a skip is expected only of a GPU-only test (marked ``cuda``) on a machine without
a GPU. Any other skip (a module skipped on a missing package, a test that skips itself) is counted in
the run's closing line as "skipped outside the GPU-only tests" and listed with its reason; with
``VEOMNI_STRICT_SKIPS=1`` (``scripts/test.sh`` sets it unless told otherwise) it fails the run, so a
test that proves interop cannot vanish unnoticed (issue 47; docs/testing.md, "Tiers and the time
budget"). ``tests/conftest.py`` registers it; it imports nothing of the project, so
``tests/house/test_skip_report.py`` loads it alone (``-p tests.skip_report``) in a quick subprocess."""

from __future__ import annotations

import os

import pytest

STRAY_SKIPS = "skipped outside the GPU-only tests"
"""The closing line's name for skips of anything but ``cuda``-marked tests."""

_stray_skips: list[pytest.TestReport | pytest.CollectReport] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "cuda" not in report.keywords:
        _stray_skips.append(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:  # a whole module skipped at import (``pytest.importorskip``, a module-level skip)
        _stray_skips.append(report)


def _strict() -> bool:
    return os.environ.get("VEOMNI_STRICT_SKIPS", "0") == "1"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _stray_skips and _strict() and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)  # after the tier lines of tests/conftest.py
def pytest_terminal_summary(terminalreporter) -> None:
    if not _stray_skips:
        return
    terminalreporter.stats[STRAY_SKIPS] = list(_stray_skips)  # counted in the closing line
    terminalreporter.write_sep("-", STRAY_SKIPS + (" (VEOMNI_STRICT_SKIPS=1: the run fails)" if _strict() else ""))
    for report in _stray_skips:
        longrepr = report.longrepr
        terminalreporter.write_line(f"{report.nodeid}: {longrepr[2] if isinstance(longrepr, tuple) else longrepr}")
