"""Minimal line/scatter charts written as PNG with Pillow (matplotlib is not a dependency).

Enough for the sweep figures: axes with tick labels, several labelled series, optional
fitted line. Pillow comes with the project's dependencies (diffusers).
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image, ImageDraw

COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


@dataclass
class Series:
    label: str
    xs: list[float]
    ys: list[float]
    line: bool = True
    """Connect the points (curves); False draws markers only (measurements under a fit)."""
    color: int | None = None
    """Index into ``COLORS``; None takes the series' position (pair a fit with its points)."""


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    step = (hi - lo) / (count - 1) if hi > lo else 1.0
    return [lo + i * step for i in range(count)]


def line_chart(path: str, title: str, xlabel: str, ylabel: str, series: list[Series],
               size: tuple[int, int] = (720, 480)) -> None:
    """Draw ``series`` on shared axes (ranges from the data, 5% margin) and save a PNG."""
    width, height = size
    left, right, top, bottom = 80, 190, 40, 60
    xs = [x for s in series for x in s.xs]
    ys = [y for s in series for y in s.ys]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    pad_x, pad_y = 0.05 * ((x1 - x0) or 1.0), 0.05 * ((y1 - y0) or 1.0)
    x0, x1, y0, y1 = x0 - pad_x, x1 + pad_x, y0 - pad_y, y1 + pad_y

    def px(x: float, y: float) -> tuple[float, float]:
        return (left + (x - x0) / (x1 - x0) * (width - left - right),
                height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom))

    img = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(img)
    draw.rectangle([left, top, width - right, height - bottom], outline="black")
    for t in _ticks(x0 + pad_x, x1 - pad_x):
        x, _ = px(t, y0)
        draw.line([x, height - bottom, x, height - bottom + 5], fill="black")
        draw.text((x - 15, height - bottom + 8), f"{t:.3g}", fill="black")
    for t in _ticks(y0 + pad_y, y1 - pad_y):
        _, y = px(x0, t)
        draw.line([left - 5, y, left, y], fill="black")
        draw.text((8, y - 6), f"{t:.4g}", fill="black")
    draw.text((width / 2 - 6 * len(title) / 2 - right / 2, 12), title, fill="black")
    draw.text((width / 2 - 3 * len(xlabel) - right / 2, height - 25), xlabel, fill="black")
    draw.text((8, top - 20), ylabel, fill="black")
    for i, s in enumerate(series):
        color = COLORS[(i if s.color is None else s.color) % len(COLORS)]
        points = [px(x, y) for x, y in zip(s.xs, s.ys)]
        if s.line and len(points) > 1:
            draw.line(points, fill=color, width=2)
        else:
            for x, y in points:
                draw.ellipse([x - 4, y - 4, x + 4, y + 4], fill=color)
        ly = top + 10 + 18 * i
        draw.line([width - right + 10, ly + 6, width - right + 30, ly + 6], fill=color, width=3)
        draw.text((width - right + 36, ly), s.label, fill="black")
    img.save(path)
