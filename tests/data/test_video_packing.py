"""NaViT packing of latent images and clips: the batch contract of a row, best fit under the
budget, and the waste measures the bench compares."""

import random

import pytest
import torch

from veomni.data.video.clip_packing import (
    LatentSample,
    best_fit_rows,
    bucket_waste,
    check_fits,
    pack_row,
    packing_waste,
    padded_batch_waste,
    patch_count,
)
from veomni.ops.video_patch import unpatchify

PATCH = (1, 2, 2)


def _sample(index: int, shape: tuple[int, int, int, int], text_len: int, generator: torch.Generator) -> LatentSample:
    return LatentSample(key=f"s{index:03d}", latent=torch.randn(shape, generator=generator),
                        text=torch.randn(text_len, 8, generator=generator), meta={"caption": f"caption {index}"})


def test_pack_row_builds_the_flow_contract_and_unpatchifies_to_the_originals():
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 1, 8, 12), (4, 5, 12, 8), (4, 3, 4, 4)]
    samples = [_sample(i, shape, text_len, g) for i, (shape, text_len) in enumerate(zip(shapes, [3, 0, 5]))]
    batch = pack_row(samples, PATCH)

    grids = [(1, 4, 6), (5, 6, 4), (3, 2, 2)]
    lengths = [24, 120, 12]
    assert batch["grid"].tolist() == [list(g) for g in grids] and batch["grid"].dtype == torch.int64
    assert batch["cu_seqlens"].tolist() == [0, 24, 144, 156] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["max_seqlen"] == 120
    assert batch["latents"].shape == (156, 4 * 1 * 2 * 2) and batch["latents"].dtype == torch.float32
    assert batch["sample_index"].tolist() == [0] * 24 + [1] * 120 + [2] * 12
    assert batch["positions"].shape == (156, 3) and batch["positions"].dtype == torch.int64
    assert batch["text_cu_seqlens"].tolist() == [0, 3, 3, 8] and batch["text_cu_seqlens"].dtype == torch.int32
    assert batch["captions"] == ["caption 0", "caption 1", "caption 2"]
    bounds = batch["cu_seqlens"].tolist()
    text_bounds = batch["text_cu_seqlens"].tolist()
    for i, (sample, grid) in enumerate(zip(samples, grids)):
        tokens = slice(bounds[i], bounds[i + 1])
        assert bounds[i + 1] - bounds[i] == lengths[i]
        torch.testing.assert_close(unpatchify(batch["latents"][tokens], grid, PATCH), sample.latent, rtol=0, atol=0)
        torch.testing.assert_close(batch["text_states"][text_bounds[i]:text_bounds[i + 1]], sample.text,
                                   rtol=0, atol=0)
        positions = batch["positions"][tokens]
        assert positions.min().item() == 0  # every sample starts its own grid
        assert (positions.max(0).values + 1).tolist() == list(grid)
        assert len({tuple(p) for p in positions.tolist()}) == lengths[i]  # one token per grid cell


def test_a_token_s_position_is_its_patch_s_place_in_the_latent():
    latent = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(2, 3, 4, 6)
    batch = pack_row([LatentSample("a", latent, torch.zeros(1, 8))], PATCH)
    for token, (f, h, w) in zip(batch["latents"], batch["positions"].tolist()):
        patch = latent[:, f, 2 * h:2 * h + 2, 2 * w:2 * w + 2]
        assert torch.equal(token, patch.reshape(-1))


def _costs(count: int, seed: int) -> list[int]:
    """A mixed stream in Wan-VAE latent sizes (16 channels, /8 spatially, 1 + (frames - 1) / 4
    frames), patch (1, 2, 2): 256p/480p/720p images and 2-5 s clips at 256p/480p."""
    images = [(1, 256, 256), (1, 256, 448), (1, 480, 832), (1, 832, 480), (1, 720, 1280)]
    clips = [(16 * s + 1, h, w) for s in (2, 3, 4, 5) for h, w in [(256, 448), (480, 832)]]
    rng = random.Random(seed)
    sizes = [rng.choice(images) if rng.random() < 0.5 else rng.choice(clips) for _ in range(count)]
    return [patch_count((16, 1 + (f - 1) // 4, h // 8, w // 8), PATCH) for f, h, w in sizes]


def test_best_fit_keeps_every_sample_once_within_the_budget():
    costs = _costs(3000, seed=1)
    budget = 32768
    tagged = list(enumerate(costs))
    rows = list(best_fit_rows(tagged, budget, cost=lambda item: item[1]))
    placed = [index for row, _ in rows for index, _ in row]
    assert sorted(placed) == list(range(len(costs)))
    assert all(sum(c for _, c in row) <= budget for row, _ in rows)
    assert rows[-1][1] == []
    for row, buffered in rows:
        # a row starts with the oldest buffered sample; what stays buffered is in stream order
        assert all(row[0][0] < index for index, _ in buffered)
        assert [i for i, _ in buffered] == sorted(i for i, _ in buffered)


def test_packing_wastes_under_two_percent_of_the_budget_on_a_mixed_stream():
    costs = _costs(4000, seed=2)
    packed = packing_waste(costs, 32768)
    assert packed.padding == 0 and packed.real + packed.padding <= packed.rows * 32768
    assert packed.fraction <= 0.02, packed
    assert bucket_waste(costs, 32768).fraction > 3 * packed.fraction


def test_a_sample_over_the_budget_is_named():
    with pytest.raises(ValueError, match=r"sample 'clip_7' with latent shape \[16, 21, 90, 160\].*75600 patches.*"
                                         r"data\.tokens_per_micro_batch=32768"):
        check_fits("clip_7", [16, 21, 90, 160], patch_count([16, 21, 90, 160], PATCH), 32768)
    with pytest.raises(ValueError, match="40 patches cannot be packed into a budget of 32"):
        list(best_fit_rows([8, 40], 32, cost=int))


def test_waste_measures_on_a_hand_counted_stream():
    costs = [3, 5, 3, 3, 6, 2]  # budget 10
    # buckets: [3, 3, 3] fills a row of 3 (9 of 10), [6] a row of 1; [5] (rows of 2) and [2] (rows of 5)
    # are part-filled last rows
    assert (bucket_waste(costs, 10).real, bucket_waste(costs, 10).rows) == (15, 2)
    everything = bucket_waste(costs, 10, drop_last=False)
    assert (everything.real, everything.padding, everything.rows) == (22, 18, 4)
    # padded to the longest: batches of 10 // 6 = 1 sample, no padding, 6 rows of 10
    padded = padded_batch_waste(costs, 10)
    assert (padded.real, padded.padding, padded.rows) == (22, 0, 6)
    assert padded.fraction == pytest.approx(1 - 22 / 60)
    # best fit: [3, 6] (9), [5, 3, 2] (10), [3] (the tail)
    rows = [row for row, _ in best_fit_rows(costs, 10, cost=int)]
    assert rows == [[3, 6], [5, 3, 2], [3]]
    assert packing_waste(costs, 10).fraction == pytest.approx(1 - 19 / 20)


def test_a_packer_restarted_from_its_buffer_makes_the_same_rows():
    costs = _costs(600, seed=3)
    budget = 40000  # no sample fills a row: the buffer after a row may hold more than the lookahead
    reference = [row for row, _ in best_fit_rows(costs, budget, cost=int, lookahead=2)]
    pulled = 0

    def stream():
        nonlocal pulled
        for cost in costs:
            pulled += 1
            yield cost

    for k, (_, buffered) in enumerate(best_fit_rows(stream(), budget, cost=int, lookahead=2), 1):
        if k % 7 == 0:
            again = [row for row, _ in best_fit_rows(costs[pulled:], budget, cost=int, lookahead=2,
                                                     buffered=buffered)]
            assert again == reference[k:]
