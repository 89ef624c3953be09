"""``scripts/bench_colocate.py --quick`` runs its sweep on 2 gloo ranks end to end: the table has
its columns and one row per share, the JSON and the chart are written, and on the same micro-batches
balanced encoder work is no more uneven than each rank encoding its own items (timings are not
checked: they are the benchmark's, on a quiet machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_colocate.py"
COLUMNS = ("image:text", "technique", "tokens/s off", "tokens/s on", "on/off", "imbalance off", "imbalance on",
           "bubble off", "bubble on", "encoder FLOPs share")


def test_quick_sweep_reports_every_column_and_balancing_evens_encoder_work(tmp_path):
    out, chart = tmp_path / "sweep.json", tmp_path / "sweep.png"
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out),
                             "--plot", str(chart)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    table = [line for line in result.stdout.splitlines() if line.startswith("|")]
    assert [c.strip() for c in table[0].strip("|").split("|")] == list(COLUMNS)
    assert [line.split("|")[1].strip() for line in table[2:]] == ["5:5", "9:1"]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["share"], r["technique"]) for r in rows] == [(0.5, "balance"), (0.9, "balance")]
    for row in rows:
        assert row["tokens_per_s_off"] > 0 and row["tokens_per_s_on"] > 0
        assert 1.0 <= row["imbalance_on"] <= row["imbalance_off"]
        assert 0 < row["encoder_flops_share"] < 1
    assert rows[0]["imbalance_off"] > 1.05  # the mix does leave the ranks' own encoder work uneven
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_technique_is_refused_before_any_rank_starts():
    result = subprocess.run([sys.executable, str(SCRIPT), "--techniques", "balance,pp9"],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 2
    assert "unknown ['pp9']; known: balance, long_short, balance+long_short, pp" in result.stderr
