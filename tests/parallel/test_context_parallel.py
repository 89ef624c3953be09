"""Context parallelism: ring attention and Mesh-Attention (alone and under Ulysses) give the
outputs and gradients of attention over the whole row, and a tiny LLM's losses, gradients and
updated parameters of one process; the bytes they send match the analytic formulas written out
here; the block kernels agree with each other and with SDPA.

Rows are packed with samples that straddle the chunk boundaries, and their lengths do not
divide by the split (so the zig-zag layout pads)."""

import pytest
import torch
import torch.distributed as dist

from harness.gloo_ranks import run_distributed
from tests.parity_utils import TINY_LLM, assert_parity, assert_records_close, run_steps, sample_lengths, tiny_model
from veomni.config.schema import ParallelConfig
from veomni.data.packing import pack_samples
from veomni.ops.attention import SeqInfo, sdpa_varlen_attention
from veomni.ops.attention_blocks import (
    Segment,
    _math_backward,
    _math_forward,
    accumulators,
    attend_block,
    attend_block_backward,
    merge_partials,
)
from veomni.parallel.comm_counter import COMM_COUNTER
from veomni.parallel.context import ContextParallelAttention, MeshGroups, _ChunkPair
from veomni.parallel.cp_cost import choose_cp_mesh, mesh_bytes
from veomni.parallel.mesh import LayoutError, ParallelDims
from veomni.parallel.row_split import RowSplit, cp_pieces, shard_batch
from veomni.parallel.sequence import check_sequence_parallel
from veomni.tasks import LM_CONTRACT

BOUNDS = [0, 7, 30, 31, 52, 77]  # 5 samples; positions 77..79 are padding before any split
ROW, HEADS, KV_HEADS, DIM = 80, 4, 2, 8


# ----- layout -------------------------------------------------------------------------------
def test_per_sample_zigzag_layout():
    total = 37  # cp=2 x sp=2 pads to a multiple of 8: 40; samples of 21 and 16, then 3 padding
    splits = [RowSplit(sp_rank=s, sp=2, cp_rank=c, cp=2) for c in range(2) for s in range(2)]
    held = [split.positions([0, 21, 37], total).tolist() for split in splits]
    # each sample in 4 pieces; cp rank 0 takes pieces 0 and 3, cp rank 1 pieces 1 and 2. Sample 0:
    # 21 = 6+5+5+5 (the spare token to piece 0), sample 1: 16 = 4+4+4+4, padding 3 = 0+1+1+1 (its
    # spare tokens continue round-robin from piece 1). Each cp rank holds 20, its sp ranks 10 each.
    rank0 = [*range(0, 6), *range(16, 21), *range(21, 25), *range(33, 37), 39]
    rank1 = [*range(6, 11), *range(11, 16), *range(25, 29), *range(29, 33), 37, 38]
    assert held == [rank0[:10], rank0[10:], rank1[:10], rank1[10:]]


def test_per_sample_zigzag_balances_causal_work():
    """(query, key) pairs per cp rank under a causal mask, counted by brute force over the
    positions each rank holds, for a row of 5 packed samples at cp = 4: within 3% of each other,
    where zig-zag over the whole row would give the busiest rank far more."""
    bounds, cp = [0, 700, 1900, 2000, 3100, 4096], 4
    sample = torch.repeat_interleave(torch.arange(5), torch.tensor([700, 1200, 100, 1100, 996]))
    start = torch.tensor(bounds[:-1])[sample]
    work = []
    for rank in range(cp):
        pos = RowSplit(cp_rank=rank, cp=cp).positions(bounds, 4096)
        work.append(int((pos - start[pos] + 1).sum()))
    assert max(work) / min(work) < 1.03
    whole_row = [int((torch.cat([torch.arange(r * 512, r * 512 + 512), torch.arange((7 - r) * 512, (8 - r) * 512)])
                      - start[torch.cat([torch.arange(r * 512, r * 512 + 512),
                                         torch.arange((7 - r) * 512, (8 - r) * 512)])] + 1).sum())
                 for r in range(cp)]
    assert max(whole_row) / min(whole_row) > 1.3


def test_shard_batch_gathers_zigzag_positions_and_counts_real_tokens():
    batch = pack_samples([[1, 2, 3, 4], [5, 6, 7, 8]])  # T = 8, cp=2: each sample in 4 pieces of 1
    parts = [shard_batch(batch, RowSplit(cp_rank=r, cp=2), LM_CONTRACT) for r in range(2)]
    assert [p["input_ids"].tolist() for p in parts] == [[1, 4, 5, 8], [2, 3, 6, 7]]
    assert [p["position_ids"].tolist() for p in parts] == [[0, 3, 0, 3], [1, 2, 1, 2]]
    assert all(torch.equal(p["cu_seqlens"], batch["cu_seqlens"]) for p in parts)
    short = pack_samples([[1, 2, 3, 4, 5]])  # T = 5 -> 8: pieces 2,1,1,1 then padding 0,1,1,1
    parts = [shard_batch(short, RowSplit(cp_rank=r, cp=2), LM_CONTRACT) for r in range(2)]
    assert [p["input_ids"].tolist() for p in parts] == [[1, 2, 5, 0], [3, 4, 0, 0]]
    assert [p["valid_tokens"] for p in parts] == [3, 2]  # padding last on every rank
    assert parts[1]["labels"].tolist()[2:] == [-100, -100]


def test_layout_errors_name_the_fix():
    with pytest.raises(LayoutError, match=r"cp_mesh=\[3, 2\] must be \[a, b\] with a x b = parallel.cp \(4\)"):
        ParallelDims.resolve(ParallelConfig(cp=4, cp_mesh=[3, 2]), 4)
    with pytest.raises(LayoutError, match="parallel.cp=3 does not divide the world size 4"):
        ParallelDims.resolve(ParallelConfig(cp=3), 4)
    dims = ParallelDims.resolve(ParallelConfig(cp=2, sp=2), 8)
    assert (dims.dp_shard, dims.row_ranks, dims.shard_size, dims.loss_size, dims.cp_mesh) == (2, 4, 8, 8, None)


# ----- block kernels ------------------------------------------------------------------------
def _qkv(seed=0, rows=ROW):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, HEADS, DIM, generator=gen), torch.randn(rows, KV_HEADS, DIM, generator=gen),
            torch.randn(rows, KV_HEADS, DIM, generator=gen))


@pytest.mark.parametrize("causal", [True, False])
def test_block_kernel_matches_sdpa_and_the_matmul_form(causal):
    q, k, v = (t.requires_grad_() for t in _qkv())
    ref = sdpa_varlen_attention(q, k, v, SeqInfo(torch.tensor(BOUNDS, dtype=torch.int32), 25), causal=causal)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    segments = [Segment(a, b, a, b) for a, b in zip(BOUNDS, BOUNDS[1:])]
    out, lse = accumulators(q, v)
    attend_block(q.detach(), k.detach(), v.detach(), segments, causal, out, lse)
    assert_parity(out, ref.detach(), "out")
    assert torch.isinf(lse[77:]).all() and torch.isfinite(lse[:77]).all()
    dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
    attend_block_backward(grad, q.detach(), k.detach(), v.detach(), out, lse, segments, causal, dq, dk, dv)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert_parity(got, want, "got")
    s = segments[1]  # the matmul form (CUDA fp32's kernel) on one segment, K/V heads repeated
    rows, keys = slice(s.q_start, s.q_end), slice(s.k_start, s.k_end)
    kr, vr = (t.detach()[keys].repeat_interleave(2, 1) for t in (k, v))
    m_out, m_lse = _math_forward(q.detach()[rows], kr, vr, causal, DIM ** -0.5)
    assert_parity(m_out, out[rows], "m_out")
    assert_parity(m_lse, lse[rows], "m_lse")
    m_dq, _, _ = _math_backward(grad[rows], q.detach()[rows], kr, vr, out[rows], lse[rows], causal, DIM ** -0.5)
    assert_parity(m_dq, dq[rows], "m_dq")


def test_chunk_pairs_skip_other_samples_and_later_pieces():
    pieces = cp_pieces([0, 8, 16], 16, 2)  # two samples of 8: pieces of 2, rank 0 holds 0 and 3 of each
    own = _ChunkPair(pieces[0], pieces[0], causal=True)
    assert own.blocks == [(((0, 2, 0, 2), (2, 4, 2, 4), (4, 6, 4, 6), (6, 8, 6, 8)), True),  # each piece itself
                          (((2, 4, 0, 2), (6, 8, 4, 6)), False)]  # piece 3 sees piece 0 of its own sample only
    other = _ChunkPair(pieces[0], pieces[1], causal=True)  # rank 1 holds pieces 1 and 2
    assert other.blocks == [(((2, 4, 0, 4), (6, 8, 4, 8)), False)]  # piece 3 sees pieces 1 and 2, side by side
    assert _ChunkPair(pieces[0], [], causal=False).blocks == []


def test_merge_of_split_keys_equals_attention_over_all_and_stays_finite_when_empty():
    q, k, v = _qkv(1, rows=12)
    (whole, whole_lse), (first, first_lse), (second, second_lse) = (accumulators(q, v) for _ in range(3))
    attend_block(q, k, v, [Segment(0, 12, 0, 12)], False, whole, whole_lse)
    attend_block(q, k[:5], v[:5], [Segment(0, 12, 0, 5)], False, first, first_lse)
    attend_block(q, k[5:], v[5:], [Segment(0, 6, 0, 7)], False, second, second_lse)  # rows 6.. see no key here
    nothing = torch.full_like(first_lse, float("-inf"))
    out, lse = merge_partials(torch.zeros_like(first), nothing, first, first_lse)
    out, lse = merge_partials(out, lse, second, second_lse)
    assert_parity(out[:6], whole[:6], "out[:6]")
    assert_parity(lse[:6], whole_lse[:6], "lse[:6]")
    assert_parity(out[6:], first[6:], "out[6:]")  # only the first block's keys
    empty, empty_lse = merge_partials(torch.zeros_like(first), nothing, torch.zeros_like(first), nothing)
    assert torch.equal(empty, torch.zeros_like(first)) and torch.isinf(empty_lse).all()


# ----- distributed attention ----------------------------------------------------------------
def _groups(rank, a, b, sp=1):
    """MeshGroups for cp rank ``rank // sp`` on a world of a*b*sp ranks laid out (cp, sp)."""
    cp_rank, sp_rank = divmod(rank, sp)
    rows = [dist.new_group([(u * a + j) * sp + s for j in range(a)]) for s in range(sp) for u in range(b)]
    cols = [dist.new_group([(v + a * i) * sp + s for i in range(b)]) for s in range(sp) for v in range(a)]
    return MeshGroups(cp_rank, a, b, rows[sp_rank * b + cp_rank // a] if a > 1 else None,
                      cols[sp_rank * a + cp_rank % a] if b > 1 else None), sp_rank


def _attention_vs_whole_row(rank, world, a, b, sp, causal):
    from veomni.parallel.sequence import UlyssesAttention

    q, k, v = (t.requires_grad_() for t in _qkv())
    seq = SeqInfo(torch.tensor(BOUNDS, dtype=torch.int32), 25)
    ref = sdpa_varlen_attention(q, k, v, seq, causal=causal)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7))
    (ref * grad).sum().backward()
    groups, sp_rank = _groups(rank, a, b, sp)
    split = RowSplit(sp_rank=sp_rank, sp=sp, cp_rank=groups.cp_rank, cp=a * b)
    positions = split.positions(BOUNDS, ROW)
    assert split.padded(ROW) == ROW  # 80 divides by 2*cp*sp for every case here

    def local(x):
        return x.detach()[positions].clone().requires_grad_()

    ql, kl, vl = local(q), local(k), local(v)
    fn = ContextParallelAttention(None, groups, causal)
    if sp > 1:  # the hybrid: Ulysses over the sp ranks of each cp rank, outside
        sp_groups = [dist.new_group(list(range(c * sp, c * sp + sp))) for c in range(a * b)]
        fn = UlyssesAttention(fn, sp_groups[groups.cp_rank], kv_repeat=1)
    with COMM_COUNTER.measure() as counter:
        out = fn(ql, kl, vl, seq)
    forward = dict(counter.bytes)
    with COMM_COUNTER.measure() as counter:
        (out * grad[positions]).sum().backward()
    backward = dict(counter.bytes)
    assert_parity(out, ref.detach()[positions], "out")
    for mine, full in ((ql, q), (kl, k), (vl, v)):
        assert_parity(mine.grad, full.grad[positions], "mine.grad")
    return forward, backward


def _notes_formula(a, b, c, h, hkv, d, e):
    """Bytes one rank sends per layer, (forward, backward) by kind, from the reference notes'
    matrix model (papers.md section 7) extended to the backward pass. Forward: a-1 query chunks
    in, b-1 K/V chunks around the ring, a-1 partial outputs + fp32 LSEs back. Backward: a-1
    (dout, out, LSE), b-1 K/V hops and b fp32 dK/dV hops (the last takes them home), a-1 fp32
    dQ chunks."""
    kv_chunk = 2 * c * hkv * d
    forward = {"cp_q": (a - 1) * c * h * (2 * d * e + 4), "cp_kv": (b - 1) * kv_chunk * e}
    backward = {"cp_q": (a - 1) * c * h * (2 * d * e + 4 + d * 4),
                "cp_kv": (b - 1) * kv_chunk * e + (b * kv_chunk * 4 if b > 1 else 0)}
    return forward, backward


CASES = [(1, 2, 1), (1, 4, 1), (2, 2, 1), (4, 1, 1), (1, 2, 2)]
CASE_IDS = ["ring2", "ring4", "mesh2x2", "mesh4x1", "sp2xring2"]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("a, b, sp", CASES, ids=CASE_IDS)
def test_context_parallel_attention_matches_the_whole_row(a, b, sp, causal):
    sent = run_distributed(_attention_vs_whole_row, a * b * sp, a, b, sp, causal)
    c, h, hkv = ROW // (a * b), HEADS // sp, KV_HEADS // sp  # tokens and heads per rank after Ulysses
    forward, backward = _notes_formula(a, b, c, h, hkv, DIM, 4)
    for got_forward, got_backward in sent:
        for kind in ("cp_q", "cp_kv"):
            assert got_forward.get(kind, 0) == forward[kind] and got_backward.get(kind, 0) == backward[kind]
        assert mesh_bytes(a, b, c, h, hkv, DIM) == {k: forward[k] + backward[k] for k in forward}


def test_mesh_sends_less_than_ring_by_the_predicted_ratio():
    """MHA at P = 4: the notes predict forward bytes 4cHD(sqrt(P)-1) for a sqrt(P) x sqrt(P) mesh
    against 2cHD(P-1) for ring, a ratio of 2/3 (plus the LSEs). Counted bytes equal ``mesh_bytes``
    (test above), so the ratio is checked on it, forward + backward, and again at P = 8 (a
    simulated count: 8 ranks do not fit this machine's tests)."""
    c, h, d = 1024, 8, 64
    ring, mesh = mesh_bytes(1, 4, c, h, h, d), mesh_bytes(2, 2, c, h, h, d)
    ring_total, mesh_total = sum(ring.values()), sum(mesh.values())
    # by hand: ring (3 fwd + 3 bwd K/V hops at fp32 + 4 fp32 dK/dV hops) x 2cHD x 4 bytes
    assert ring_total == (3 + 3 + 4) * 2 * c * h * d * 4
    # mesh 2x2: row traffic cH(4D·4 + 4D + 8) + column (1 + 1 + 2) x 2cHD x 4
    assert mesh_total == c * h * (16 * d + 4 * d + 8) + 4 * 2 * c * h * d * 4
    assert mesh_total / ring_total == pytest.approx((20 * d + 8 + 32 * d) / (80 * d))  # ~0.65
    ring8, mesh8 = sum(mesh_bytes(1, 8, c, h, h, d).values()), sum(mesh_bytes(2, 4, c, h, h, d).values())
    assert mesh8 / ring8 < mesh_total / ring_total
    for a in (1, 2, 4, 8):  # cp = 8, GQA, bf16: the dry run's count against the notes' formula
        forward, backward = _notes_formula(a, 8 // a, c, h, 2, d, 2)
        assert mesh_bytes(a, 8 // a, c, h, 2, d, 2) == {k: forward[k] + backward[k] for k in forward}


def test_automatic_shape_hides_the_ring_when_compute_allows():
    args = dict(tokens=4096, heads=8, kv_heads=8, head_dim=64, elem_bytes=2)
    ring_bytes = sum(mesh_bytes(1, 8, 4096, 8, 8, 64, 2).values())
    # slow compute: the ring's traffic hides behind it, so ring wins (no exposed row traffic)
    assert choose_cp_mesh(8, bandwidth=1e11, compute_seconds=10 * ring_bytes / 1e11, **args) == (1, 8)
    # fast compute on a slow link: the least traffic wins. Per c*H bytes (bf16, fp32 gradients):
    # row (a-1)(4*64*2 + 4*64 + 8) = 776 (a-1), column 128 ((b-1) 4 + 4b): ring 7680, 2x4 4360,
    # 4x2 3864, 8x1 5432
    assert choose_cp_mesh(8, bandwidth=1e9, compute_seconds=0.0, **args) == (4, 2)


# ----- the LLM end to end -------------------------------------------------------------------
STEPS = [sample_lengths(7, seed=20), sample_lengths(5, seed=21)]  # odd totals: the layout pads


def _run(rank, world, parallel):
    return run_steps([[samples] for samples in STEPS], parallel)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_run, 1, ParallelConfig())[0]


@pytest.mark.parametrize("world, parallel", [
    (2, ParallelConfig(cp=2, cp_mesh=[1, 2])),
    (4, ParallelConfig(cp=4, cp_mesh=[1, 4])),
    (4, ParallelConfig(cp=4, cp_mesh=[2, 2])),
    (4, ParallelConfig(sp=2, cp=2, cp_mesh=[1, 2])),
], ids=["ring2", "ring4", "mesh2x2", "sp2xring2"])
def test_llm_matches_single_process(reference, world, parallel):
    for got in run_distributed(_run, world, parallel):
        assert_records_close(reference, got)


def test_llm_rows_do_not_divide_by_the_split():
    totals = [pack_samples(s)["input_ids"].numel() for s in STEPS]
    assert all(t % 8 for t in totals)
    assert TINY_LLM["num_heads"] % 8 == 4  # 4 heads: Ulysses alone stops at 4 ranks


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused varlen block kernel needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_flash_blocks_match_the_fp32_matmul_form(dtype):
    """Diagonal (causal) and off-diagonal (full) blocks with several segments, GQA, through flash
    attention's varlen kernel, against the fp32 matmul form on the same inputs."""
    from veomni.ops.attention_blocks import _fold_kv

    gen = torch.Generator().manual_seed(3)
    diagonal = [Segment(0, 100, 0, 100), Segment(100, 357, 100, 357), Segment(357, 512, 357, 512)]
    full = [Segment(0, 100, 0, 200), Segment(100, 512, 200, 512)]
    for segments, causal in ((diagonal, True), (full, False)):
        q = torch.randn(512, 8, 64, generator=gen).cuda().to(dtype)
        k, v = (torch.randn(512, 2, 64, generator=gen).cuda().to(dtype) for _ in range(2))
        out, lse = accumulators(q, v)
        attend_block(q, k, v, segments, causal, out, lse)
        out = out.to(dtype)
        dout = torch.randn_like(out)
        dq, dk, dv = (torch.zeros(t.shape, device=t.device) for t in (q, k, v))
        attend_block_backward(dout, q, k, v, out, lse, segments, causal, dq, dk, dv)
        for s in segments:
            rows, keys = slice(s.q_start, s.q_end), slice(s.k_start, s.k_end)
            kr, vr = (t[keys].float().repeat_interleave(4, 1) for t in (k, v))
            ref_out, ref_lse = _math_forward(q[rows].float(), kr, vr, causal, 64 ** -0.5)
            torch.testing.assert_close(out[rows].float(), ref_out, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(lse[rows], ref_lse, atol=2e-2, rtol=2e-2)
            gq, gk, gv = _math_backward(dout[rows].float(), q[rows].float(), kr, vr, out[rows].float(), lse[rows],
                                        causal, 64 ** -0.5)
            torch.testing.assert_close(dq[rows], gq, atol=5e-2, rtol=5e-2)
            torch.testing.assert_close(dk[keys], _fold_kv(gk, 4), atol=5e-2, rtol=5e-2)
            torch.testing.assert_close(dv[keys], _fold_kv(gv, 4), atol=5e-2, rtol=5e-2)


def test_launch_checks_name_what_context_parallelism_needs():
    model = tiny_model()
    assert check_sequence_parallel(model, 1, 8) == []  # 4 heads: cp has no head limit
    assert "parallel.sp=8 does not divide the 4 attention heads" in check_sequence_parallel(model, 8, 1)[0]
    assert "put the other ranks in parallel.cp" in check_sequence_parallel(model, 8, 1)[0]
    for layer in model.layers:  # an attention module without the attn_fn injection point declares no AttentionModule
        del layer.attn.attn_fn
    problem = check_sequence_parallel(model, 1, 2)[0]
    assert ("parallel.cp=2: DecoderLM: layers.0.attn (Attention) is listed in parallel_plan().attention but does "
            "not implement veomni.contract.hooks.AttentionModule") in problem
    assert "causal" in problem
