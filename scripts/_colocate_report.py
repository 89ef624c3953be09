"""The report of ``scripts/bench_colocate.py``: per media share and technique, tokens/s off and on,
their ratio, the encoder-work imbalance, the pipeline bubble and the encoders' share of the FLOPs,
as a markdown table and a line chart. Reads the per-rank points the sweep's workers return
(``{"share", "flops", "encoder_flops", "runs": {run name: {"times", "tokens", "loads"[, "busy"]}}}``)."""

from __future__ import annotations

import statistics
from pathlib import Path

from _plot import Series, line_chart


def tokens_per_s(points: list[dict], name: str) -> float:
    """Median over measured steps of the global LLM tokens over the slower rank's step time."""
    runs = [p["runs"][name] for p in points]
    return statistics.median(tokens / max(times) for tokens, *times in
                             zip(runs[0]["tokens"], *(r["times"] for r in runs)))


def imbalance(points: list[dict], name: str) -> float:
    """The encoder time the ranks wait for over the time a perfect split would take: summed over
    the measured steps, the busiest rank's encoder FLOPs over the mean rank's (a step with one
    small image weighs what its encoder work weighs)."""
    steps = list(zip(*(p["runs"][name]["loads"] for p in points)))
    mean = sum(statistics.mean(loads) for loads in steps)
    return sum(max(loads) for loads in steps) / mean if mean else 1.0


def bubble(points: list[dict], name: str) -> float | None:
    """A pipeline run's idle fraction: the ranks' step time outside their stage chunks and encoder
    passes, over their step time, summed over steps and ranks; None for runs without a pipeline."""
    runs = [p["runs"][name] for p in points]
    if "busy" not in runs[0]:
        return None
    wall = sum(sum(r["times"]) for r in runs)
    return (wall - sum(sum(r["busy"]) for r in runs)) / wall


def summarize(ranks: list[list[dict]], baselines: dict[str, str]) -> list[dict]:
    """One row per share and technique (``baselines``: each technique's run -> the run it is compared with)."""
    rows = []
    for points in zip(*ranks):
        encoder_share = sum(p["encoder_flops"] for p in points) / sum(p["flops"] for p in points)
        for name, baseline in baselines.items():
            off, on = tokens_per_s(points, baseline), tokens_per_s(points, name)
            rows.append({"share": points[0]["share"], "technique": name, "tokens_per_s_off": off,
                         "tokens_per_s_on": on, "ratio": on / off, "imbalance_off": imbalance(points, baseline),
                         "imbalance_on": imbalance(points, name), "bubble_off": bubble(points, baseline),
                         "bubble_on": bubble(points, name), "encoder_flops_share": encoder_share})
    return rows


def print_table(rows: list[dict], modality: str) -> None:
    def percent(value: float | None) -> str:
        return "-" if value is None else f"{value:.1%}"

    print(f"| {modality}:text | technique | tokens/s off | tokens/s on | on/off | imbalance off | imbalance on "
          "| bubble off | bubble on | encoder FLOPs share |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        media = round(10 * r["share"])
        print(f"| {media}:{10 - media} | {r['technique']} | {r['tokens_per_s_off']:,.0f} | {r['tokens_per_s_on']:,.0f} "
              f"| {r['ratio']:.3f} | {r['imbalance_off']:.3f} | {r['imbalance_on']:.3f} | {percent(r['bubble_off'])} "
              f"| {percent(r['bubble_on'])} | {r['encoder_flops_share']:.1%} |")


def plot(path: Path, rows: list[dict], techniques: list[str], title: str, modality: str) -> None:
    def series(label: str, technique: str, key: str) -> Series:
        points = [r for r in rows if r["technique"] == technique]
        return Series(label, [100 * r["share"] for r in points], [r[key] for r in points])

    lines = [series("imbalance off", techniques[0], "imbalance_off")]
    for name in techniques:
        lines += [series(f"imbalance {name}", name, "imbalance_on"), series(f"tokens/s {name}/off", name, "ratio")]
    path.parent.mkdir(parents=True, exist_ok=True)
    line_chart(str(path), title, f"{modality} samples (%)", "ratio", lines)
