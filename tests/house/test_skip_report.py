"""A run that skips anything but a GPU-only (``cuda``-marked) test says so in its closing line, lists
it with its reason, and fails under ``VEOMNI_STRICT_SKIPS=1`` (what ``scripts/test.sh`` sets): an
interop test skipped on a missing package cannot pass unnoticed (issue 47). Runs pytest on three
planted test files in a subprocess with ``tests/skip_report.py`` as its plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PLANTED = {
    "pytest.ini": "[pytest]\nmarkers =\n    cuda: needs a CUDA GPU\n",
    "test_missing_package.py": 'import pytest\npytest.importorskip("no_such_package_for_veomni")\n',
    "test_skips_itself.py": "import pytest\n\n\ndef test_skipped():\n    pytest.skip('no reason good enough')\n",
    "test_gpu_only.py": ("import pytest\n\n\n@pytest.mark.cuda\ndef test_gpu():\n    pytest.skip('needs a GPU')\n\n\n"
                         "def test_runs():\n    pass\n"),
}


def test_skips_outside_gpu_tests_are_named_counted_and_fail_strict_runs(tmp_path):
    for name, text in PLANTED.items():
        (tmp_path / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(REPO), "VEOMNI_STRICT_SKIPS": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.skip_report", "-p", "no:cacheprovider", "-q"],
                            cwd=tmp_path, env=env, capture_output=True, text=True)
    closing = result.stdout.strip().splitlines()[-1]
    assert "1 passed, 3 skipped, 2 skipped outside the GPU-only tests in" in closing, result.stdout
    listed = result.stdout.split("skipped outside the GPU-only tests (VEOMNI_STRICT_SKIPS=1: the run fails)")[1]
    assert "test_missing_package.py: Skipped: could not import 'no_such_package_for_veomni'" in listed
    assert "test_skips_itself.py::test_skipped: Skipped: no reason good enough" in listed
    assert "test_gpu_only" not in listed.split("short test summary")[0], "a GPU-only skip is expected, not listed"
    assert result.returncode == 1, result.stdout
