"""The dry run's "sequence split" section: bytes and buffers per method, against the messages
each method sends and the tensors it holds, counted here by hand for a small config."""

from veomni.planner.sequence_split import AttentionShape, sequence_split_lines, split_cost, split_layouts

# 2 layers, 4 query heads, 2 K/V heads of 8, fp32; 100 tokens (padded to 104 under cp: 2 x cp x sp = 8)
ATTN = AttentionShape(layers=2, heads=4, kv_heads=2, head_dim=8)
E = 4


def test_layouts_skip_the_splits_the_heads_do_not_fit():
    six = AttentionShape(layers=2, heads=6, kv_heads=2, head_dim=8)
    # sp=4 does not divide 6 heads: no Ulysses over 4, no 4 x 1 hybrid
    assert split_layouts(six, 4) == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2), (2, 2, 1)]
    # 4 heads / 2 K/V heads: Ulysses 4 fits by repeating K/V twice
    assert (4, 1, 1) in split_layouts(ATTN, 4)


def test_ring_over_four_ranks():
    c = 104 // 4  # tokens per cp chunk
    kv_chunk = c * 2 * 8 * E  # one of K or V
    forward = 3 * 2 * kv_chunk  # 3 hops of K and V
    backward = 3 * 2 * kv_chunk + 4 * 2 * c * 2 * 8 * 4  # K/V again, fp32 dK/dV 4 hops (the last takes them home)
    cost = split_cost(ATTN, 100, sp=1, a=1, b=4, elem_bytes=E, checkpointing="none")
    assert cost.comm_bytes == 2 * (forward + backward) == 66_560
    # two K/V chunks (held + arriving), fp32 dK/dV, fp32 output + LSE accumulator of 4 heads
    buffers = 2 * 2 * kv_chunk + 2 * c * 2 * 8 * 4 + c * 4 * (8 + 1) * 4
    assert cost.buffer_bytes == buffers == 13_728
    assert cost.name == "ring"


def test_mesh_two_by_two_with_checkpointing_and_accumulation():
    c = 26
    q_chunk = c * 4 * 8 * E
    kv_chunk = c * 2 * 8 * E
    forward = (q_chunk  # the row partner's queries
               + 2 * kv_chunk  # one hop of K and V down the column
               + c * 4 * (8 * E + 4))  # the partner's partial outputs and LSEs
    backward = (c * 4 * (2 * 8 * E + 4)  # dout, out, LSE to the row partner
                + 2 * kv_chunk + 2 * 2 * c * 2 * 8 * 4  # K/V one hop, fp32 dK/dV two hops
                + c * 4 * 8 * 4)  # fp32 dQ back to its owner
    assert (forward, backward) == (10_400, 20_384)
    cost = split_cost(ATTN, 100, sp=1, a=2, b=2, elem_bytes=E, checkpointing="full", grad_accum=3)
    assert cost.comm_bytes == 3 * 2 * (2 * forward + backward)  # the forward runs again under checkpointing
    # K/V held + arriving, fp32 dK/dV, fp32 accumulators for 2 query chunks, one layer's saved partner queries
    buffers = 2 * 2 * kv_chunk + 2 * c * 2 * 8 * 4 + 2 * c * 4 * 9 * 4 + q_chunk
    assert cost.buffer_bytes == buffers == 20_800
    assert cost.name == "mesh 2x2"
    # without checkpointing the partner's queries stay saved in both layers
    assert split_cost(ATTN, 100, 1, 2, 2, E, "none").buffer_bytes == buffers + q_chunk


def test_hybrid_ulysses_two_by_ring_two():
    t = 104 // 4  # tokens per rank
    # all-to-alls of q (4 heads), k, v (2 heads), out (4 heads); half of each leaves the rank
    ulysses = 2 * (t * 4 * 8 * E + 2 * t * 2 * 8 * E + t * 4 * 8 * E) // 2
    c = 104 // 2  # after the exchange: the whole cp chunk, 2 heads, 1 K/V head
    ring = 2 * (2 * c * 8 * E) + 2 * 2 * c * 8 * 4  # K/V one hop forward and backward, fp32 dK/dV two hops
    cost = split_cost(ATTN, 100, sp=2, a=1, b=2, elem_bytes=E, checkpointing="none")
    assert cost.comm_bytes == 2 * (ulysses + ring) == 46_592
    assert cost.buffer_bytes == 2 * 2 * c * 8 * E + 2 * c * 8 * 4 + c * 2 * 9 * 4 == 13_728
    assert cost.name == "Ulysses 2 x ring"


def test_ulysses_repeats_kv_heads_to_fit():
    t = 100 // 4
    per_pass = (t * 4 * 8 * E) * 4 * 3 // 4  # q, k, v (2 K/V heads repeated to 4), out; 3/4 of each leaves
    cost = split_cost(ATTN, 100, sp=4, a=1, b=1, elem_bytes=E, checkpointing="none")
    assert cost.comm_bytes == 2 * 2 * per_pass == 38_400 and cost.buffer_bytes == 0


def test_report_marks_the_recipe_and_names_the_automatic_choice():
    lines = sequence_split_lines(AttentionShape(2, 6, 2, 8), 100, sp=2, cp=2, cp_mesh=(1, 2), elem_bytes=E,
                                 checkpointing="none", grad_accum=1, activation_bytes=1000.0)
    text = "\n".join(lines)
    assert [line.split()[0:4] for line in lines if "<- recipe" in line] == [["Ulysses", "2", "x", "ring"]]
    assert "no Ulysses over 4" in text and "cp_mesh: []" not in text
    auto = sequence_split_lines(ATTN, 4096, sp=1, cp=4, cp_mesh=None, elem_bytes=2, checkpointing="none",
                                grad_accum=1, activation_bytes=0.0)
    marked = [line for line in auto if "<- recipe" in line]
    assert len(marked) == 1 and "if link-bound" in marked[0]
    assert any(line.strip().startswith("cp_mesh: [] is chosen at start-up") for line in auto)
    assert "no Ulysses" not in "\n".join(auto)
