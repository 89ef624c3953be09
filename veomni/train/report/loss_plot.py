"""``loss.png``: the training loss, the eval losses and the eval baseline of a run, as a picture
(and ``reward.png``, the sampled reward's mean per step, for an RL run: its loss says little).

Written to the output folder at every eval and at the end of every run (also a stopped one), so a
run shows whether it learns without TensorBoard or wandb. Drawn with Pillow, which the project
already needs for image samples, rather than adding matplotlib as a dependency for one chart.
The points come from ``metrics.jsonl``, so a resumed run's plot covers the steps before it too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from PIL import Image, ImageDraw

PLOT_FILE = "loss.png"
REWARD_PLOT_FILE = "reward.png"
SIZE = (900, 520)
MARGIN = (70, 30, 30, 50)  # left, top, right, bottom
TRAIN_COLOUR, EVAL_COLOUR, BASELINE_COLOUR, AXIS_COLOUR = (31, 119, 180), (214, 39, 40), (120, 120, 120), (0, 0, 0)

Points = list[tuple[int, float]]


def read_series(metrics_file: Path, keys: Sequence[str]) -> tuple[Points, ...]:
    """Each of ``keys`` as (step, value) points from ``metrics.jsonl``; a step repeated by a resume
    keeps its newest value."""
    series: dict[str, dict[int, float]] = {key: {} for key in keys}
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            record = json.loads(line)
            for key, points in series.items():
                if isinstance(record.get(key), (int, float)):
                    points[record["step"]] = float(record[key])
    return tuple(sorted(points.items()) for points in series.values())


def _scale(low: float, high: float, start: int, end: int):
    span = (high - low) or 1.0
    return lambda value: start + (value - low) / span * (end - start)


def _polyline(draw: ImageDraw.ImageDraw, points: Sequence[tuple[float, float]], colour, dots: bool) -> None:
    """A line through ``points``, with a dot on each when ``dots``; a lone point is always a dot (a
    line of one point draws nothing, and the legend names every series)."""
    if len(points) > 1:
        draw.line(points, fill=colour, width=2)
    if dots or len(points) == 1:
        for x, y in points:
            draw.ellipse((x - 4, y - 4, x + 4, y + 4), fill=colour)


def read_losses(metrics_file: Path) -> tuple[Points, Points, Points]:
    """(train loss, eval loss, eval baseline) points from ``metrics.jsonl``."""
    return read_series(metrics_file, ("loss", "eval_loss", "eval_baseline"))


def draw_losses(train: Points, evals: Points, baseline: Points, out: Path, title: str,
                names: Sequence[str] = ("train loss", "eval loss", "eval baseline")) -> Path:
    """Write the chart to ``out``: steps across, values up, with labelled axis ends and a legend
    naming the three series (``names``)."""
    image = Image.new("RGB", SIZE, "white")
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = MARGIN[0], MARGIN[1], SIZE[0] - MARGIN[2], SIZE[1] - MARGIN[3]
    values = [v for _, v in train + evals + baseline]
    steps = [s for s, _ in train + evals + baseline]
    draw.rectangle((left, top, right, bottom), outline=AXIS_COLOUR)
    draw.text((left, 8), title, fill=AXIS_COLOUR)
    if values:
        pad = 0.05 * ((max(values) - min(values)) or 1.0)  # lines on the frame's edge are hard to see
        low, high = min(values) - pad, max(values) + pad
        x = _scale(min(steps), max(steps), left, right)
        y = _scale(low, high, bottom, top)
        for value in (low, (low + high) / 2, high):
            draw.text((4, y(value) - 6), f"{value:.3f}", fill=AXIS_COLOUR)
        draw.text((left, bottom + 8), f"step {min(steps)}", fill=AXIS_COLOUR)
        draw.text((right - 70, bottom + 8), f"step {max(steps)}", fill=AXIS_COLOUR)
        _polyline(draw, [(x(s), y(v)) for s, v in train], TRAIN_COLOUR, dots=False)
        _polyline(draw, [(x(s), y(v)) for s, v in baseline], BASELINE_COLOUR, dots=False)
        _polyline(draw, [(x(s), y(v)) for s, v in evals], EVAL_COLOUR, dots=True)
    legend = [(name, colour) for name, colour in zip(names, (TRAIN_COLOUR, EVAL_COLOUR, BASELINE_COLOUR)) if name]
    for index, (name, colour) in enumerate(legend):
        draw.text((left + 120 + 130 * index, bottom + 28), f"--- {name}", fill=colour)
    image.save(out)
    return out


def write_loss_plot(output_dir: Path) -> Path:
    """``<output_dir>/loss.png`` from ``<output_dir>/metrics.jsonl``, and ``reward.png`` beside it
    when the metrics hold a sampled reward (``reward_mean``, ``train.objective: grpo``)."""
    train, evals, baseline = read_losses(output_dir / "metrics.jsonl")
    (rewards,) = read_series(output_dir / "metrics.jsonl", ("reward_mean",))
    if rewards:
        draw_losses(rewards, [], [], output_dir / REWARD_PLOT_FILE, f"{output_dir.name}: mean sampled reward per step",
                    names=("reward_mean", "", ""))
    return draw_losses(train, evals, baseline, output_dir / PLOT_FILE, f"{output_dir.name}: loss per step")
