"""The context-parallel long-context recipes, run as a user runs them: ``bash scripts/train.sh ...``
(the 128k GPU recipe as its planned dry runs, the 32k CPU recipe at a CI-sized row)."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.launch.test_launch import dry_run, train_sh

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
LONG = REPO / "recipes" / "long-context"
GiB = 2**30


def _table(stdout: str) -> dict[str, list[str]]:
    """The dry run's sequence-split rows by method name."""
    section = stdout[stdout.index("sequence split ("):].splitlines()[2:]
    rows = {}
    for line in section:
        match = re.match(r"  (\S.*?)\s{2,}(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)(.*)$", line)
        if match:
            rows[match.group(1)] = list(match.groups()[1:])
    return rows


@pytest.mark.parametrize("cp, extra", [(8, []), (16, ["--parallel.cp", "16"])], ids=["cp8", "cp16"])
def test_128k_recipe_plans_at_cp_8_and_16(cp, extra, capfd):
    result = dry_run(capfd, str(LONG / "tiny_128k.yaml"), "--world-size", str(cp), "--gpus", *extra)
    assert result.returncode == 0, result.stderr
    assert f"cp={cp} (auto)" in result.stdout
    rows = _table(result.stdout)
    # 12 query / 4 K/V heads: Ulysses fits 2 and 4 ranks, never 8 or 16
    expected = {"ring", *(f"mesh {a}x{cp // a}" for a in (2, 4, 8, 16) if a <= cp)}
    for sp in (2, 4):
        expected |= {f"Ulysses {sp} x ring", *(f"Ulysses {sp} x mesh {a}x{cp // sp // a}"
                                                for a in (2, 4, 8) if a <= cp // sp)}
    assert set(rows) == expected
    assert f"no Ulysses over {cp}" in result.stdout and "cp_mesh: [] is chosen at start-up" in result.stdout
    assert sum("<- recipe" in row[-1] for row in rows.values()) == 1
    # ring, bf16, full checkpointing: K/V chunks of c = 131072/cp tokens x 4 heads x 128 make cp-1 hops
    # forward (twice: recomputed) and backward, and fp32 dK/dV make cp hops; 12 layers
    kv_chunk = 2 * (131072 // cp) * 4 * 128  # K and V elements
    ring = 12 * (3 * (cp - 1) * kv_chunk * 2 + cp * kv_chunk * 4)
    assert rows["ring"][2] == f"{ring / GiB:.3f}", rows["ring"]


def _train_32k(tmp_path, nproc: int, *overrides: str) -> subprocess.CompletedProcess:
    out = tmp_path / "run"
    result = train_sh(str(LONG / "tiny_32k_cp.yaml"), "--data.max_seq_len", "2048", "--data.tokens_per_micro_batch",
                      "2048", "--train.max_steps", "2", "--train.output_dir", str(out), "--train.sample_tokens", "4",
                      *overrides, env={"NPROC_PER_NODE": str(nproc)}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(0 < loss < 20 for loss in losses)
    assert any("eval_loss" in r for r in records)
    assert (out / "checkpoints" / "step_00000002" / "complete.json").is_file()
    return result


def test_32k_cp_recipe_trains_with_ring_attention(tmp_path):
    result = _train_32k(tmp_path, 2)
    assert "cp=2 (ring)" in result.stderr and "(Ulysses)" not in result.stderr


def test_six_heads_train_on_four_ranks_as_ulysses_2_x_ring_2(tmp_path):
    """6 heads do not divide by 4, so Ulysses alone cannot use 4 ranks; the hybrid can."""
    result = _train_32k(tmp_path, 4, "--parallel.sp", "2", "--model.num_heads", "6", "--model.num_kv_heads", "2")
    assert "cp=2 (ring)  sp=2 (Ulysses)" in result.stderr
