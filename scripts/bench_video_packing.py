"""Patch budget wasted by NaViT packing vs resolution buckets, on generated image/clip streams.

    python scripts/bench_video_packing.py [--samples 20000] [--seed 0] [--lookahead 1 2 4 8 16]

Two streams, drawn with a fixed seed (the numbers are deterministic, nothing is timed):

- ``bundled``: the bundled moving-shapes clips (H, W in {32, 48}, F in {1, 5, 9}) through the
  stage-0 VAE (4 channels, spatial factor 4, no temporal compression), patch (1, 2, 2), budget
  1024 patches: latent grids of 16 to 324 patches, every combination equally likely.
- ``wan``: a realistic mix in Wan-VAE latent sizes (16 channels, spatial factor 8, temporal 4:
  ``1 + (frames - 1) / 4`` latent frames), patch (1, 2, 2), budget 32768 patches (a 480p 5 s clip,
  32760 patches, fits one row): images at 256p, 480p and 720p in landscape and portrait, and 2-5 s
  clips (16 fps) at 256p and 480p (``WAN_MIX``).

For each stream: the waste (``veomni.data.video.clip_packing.Waste.fraction``: the share of the rows'
budget that holds no sample patch) of our packing at each lookahead, of resolution buckets padded
to the budget (``bucket_waste``), and of fixed-size batches padded to the longest sample
(``padded_batch_waste``); each scheme's last, part-filled rows are left out. The ratio column is a
scheme's waste over our packing's at the default lookahead.
"""

from __future__ import annotations

import argparse
import random

from veomni.data.video.clip_packing import (
    LOOKAHEAD_ROWS,
    Waste,
    bucket_waste,
    packing_waste,
    padded_batch_waste,
    patch_count,
)

PATCH = (1, 2, 2)


def wan_latent(frames: int, height: int, width: int) -> tuple[int, int, int, int]:
    """The Wan VAE's latent shape of a clip (an image is 1 frame)."""
    return 16, 1 + (frames - 1) // 4, height // 8, width // 8


IMAGE_SIZES = {"256p": [(256, 256), (256, 448), (448, 256)], "480p": [(480, 832), (832, 480), (480, 480)],
               "720p": [(720, 1280), (1280, 720)]}
CLIP_SIZES = {"256p": [(256, 448)], "480p": [(480, 832), (832, 480)]}
WAN_MIX = [  # (latent shape, weight): half images, half clips
    *[(wan_latent(1, h, w), 0.5 / 3 / len(sizes)) for sizes in IMAGE_SIZES.values() for h, w in sizes],
    *[(wan_latent(16 * seconds + 1, h, w), 0.5 / 2 / len(sizes) / 4)
      for sizes in CLIP_SIZES.values() for h, w in sizes for seconds in (2, 3, 4, 5)],
]
BUNDLED_MIX = [((4, f, h // 4, w // 4), 1.0) for f in (1, 5, 9) for h in (32, 48) for w in (32, 48)]
STREAMS = {"bundled": (BUNDLED_MIX, 1024), "wan": (WAN_MIX, 32768)}


def draw_costs(mix: list[tuple[tuple[int, ...], float]], samples: int, seed: int) -> list[int]:
    shapes, weights = zip(*mix)
    rng = random.Random(seed)
    return [patch_count(shape, PATCH) for shape in rng.choices(shapes, weights, k=samples)]


def line(name: str, waste: Waste, reference: Waste) -> str:
    ratio = waste.fraction / reference.fraction if reference.fraction else float("inf")
    return (f"  {name:<32} waste {waste.fraction:7.2%}   padding {waste.padding / (waste.rows * waste.budget):7.2%}"
            f"   rows {waste.rows:6d}   ratio {ratio:8.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lookahead", type=int, nargs="+", default=sorted({1, 2, 4, LOOKAHEAD_ROWS, 16}))
    args = parser.parse_args()
    for stream, (mix, budget) in STREAMS.items():
        costs = draw_costs(mix, args.samples, args.seed)
        reference = packing_waste(costs, budget)
        print(f"{stream}: {args.samples} samples, {min(costs)}-{max(costs)} patches each "
              f"(mean {sum(costs) / len(costs):.0f}), budget {budget} patches per row")
        for lookahead in args.lookahead:
            default = " (default)" if lookahead == LOOKAHEAD_ROWS else ""
            print(line(f"packing, lookahead {lookahead}{default}", packing_waste(costs, budget, lookahead), reference))
        print(line("buckets padded to budget", bucket_waste(costs, budget), reference))
        print(line("batches padded to longest", padded_batch_waste(costs, budget), reference))


if __name__ == "__main__":
    main()
