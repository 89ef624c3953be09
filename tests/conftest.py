"""Every test sees the zoo registered, as a recipe with the default ``model.plugins`` does; the
recipe tests of the tiny VLM share one small VQA build (``vqa_build``).

Two tiers (docs/testing.md, "Tiers and the time budget"): a test module marked
``pytestmark = pytest.mark.full`` (whole training runs through ``scripts/train.sh``, multi-rank
trainer runs, recipe checks) belongs to the full tier; everything else (unit and parity tests) is
the fast tier a developer runs with ``bash scripts/test.sh --fast``. The end of every run prints
each tier's time against its budget, so a slow newcomer shows up in the run that added it.
Skips of anything but GPU-only tests are reported by ``tests/skip_report.py``, registered here."""

from collections import defaultdict
from pathlib import Path

import pytest

from tests import skip_report
from tests.omni_utils import build_vqa
from veomni.contract import load_plugins

load_plugins()

BUDGET_S = {"fast": 300, "full": 1200 - 300}
"""Seconds on an idle 2-core machine: the fast tier, and the rest of the whole suite's 20 minutes."""

_spent: dict[str, float] = defaultdict(float)
_counted: dict[str, int] = defaultdict(int)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "full: the full tier (whole runs, multi-rank trainers, recipes); "
                                       "bash scripts/test.sh --fast leaves it out")
    config.pluginmanager.register(skip_report, "veomni-skip-report")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tier = "full" if "full" in report.keywords else "fast"
    _spent[tier] += report.duration
    if report.when == "call":
        _counted[tier] += 1


def pytest_terminal_summary(terminalreporter) -> None:
    lines = [f"{tier} tier: {_counted[tier]} tests, {_spent[tier]:.0f} s (budget {BUDGET_S[tier]} s on an idle "
             f"2-core machine{'; over it: see docs/testing.md' if _spent[tier] > BUDGET_S[tier] else ''})"
             for tier in BUDGET_S if _counted[tier]]
    if lines:
        terminalreporter.write_sep("-", "test tiers")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def vqa_build(tmp_path_factory) -> Path:
    """A VQA build of 400 training and 40 held-out samples (``data/build_vqa.py``): ``train/``, ``eval/``."""
    folder = tmp_path_factory.mktemp("vqa")
    build_vqa(folder, 400, 40)
    return folder
