"""What only a GPU runs, checked where one is (``pytest -m cuda``, part of ``scripts/gpu_check.sh``).

- The CUDA varlen kernel (bf16, GQA and MHA, causal and full) equals an fp32 reference: on
  torch 2.11 its call raised ``TypeError`` at the first forward (``enable_gqa``).
- The process group a GPU run starts (``cpu:gloo,cuda:nccl``) takes a CPU scalar and a CUDA
  tensor in the same run, as the trainer hands it both: on a NCCL-only group the CPU scalar died
  before step 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from veomni.ops.attention import SeqInfo, sdpa_varlen_attention, varlen_attention

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (4, 4)], ids=["gqa-8-2", "mha"])
def test_cuda_varlen_attention_in_bf16_matches_fp32(heads, kv_heads, causal):
    gen = torch.Generator().manual_seed(0)
    lengths = [37, 5, 120, 64]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = (torch.randn(sum(lengths) + 3, h, 64, generator=gen) for h in (heads, kv_heads, kv_heads))
    seq = SeqInfo(cu, max(lengths))
    want = sdpa_varlen_attention(q, k, v, seq, causal=causal)
    cuda = SeqInfo(cu.cuda(), max(lengths))
    got = varlen_attention(*(t.cuda().bfloat16() for t in (q, k, v)), cuda, causal=causal).float().cpu()
    assert got[-3:].abs().max() == 0, "padding rows are zero"
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # bf16 against fp32: close, not equal


def test_the_gpu_process_group_takes_cpu_scalars_and_cuda_tensors():
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from veomni.train.distributed import all_reduce_values, init_distributed
        device = init_distributed("cuda")
        assert all_reduce_values([1.5, 2.0]) == [1.5, 2.0]  # CPU float64 over gloo
        tensor = torch.ones(4, device=device)
        dist.all_reduce(tensor)  # CUDA over NCCL
        gathered = [None]
        dist.all_gather_object(gathered, {"rank": 0})
        assert tensor.sum().item() == 4 and gathered == [{"rank": 0}]
        dist.destroy_process_group()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
