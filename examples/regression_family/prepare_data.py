"""Write the toy regression data: ``python prepare_data.py --train-out T.pt --eval-out E.pt``.

The recipe's ``data.prepare``: the launcher runs it when a data file is missing. Rows are
x ~ N(0, 1) with a target that is mostly linear in x plus a smooth non-linear part, all from
fixed seeds, so every run (and every test) sees the same data.
"""

import argparse
from pathlib import Path

import torch

IN_FEATURES = 8


def make_rows(rows: int, seed: int) -> dict[str, torch.Tensor]:
    weights = torch.Generator().manual_seed(0)  # one target function for both splits
    w = torch.randn(IN_FEATURES, 1, generator=weights) / IN_FEATURES ** 0.5
    v = torch.randn(IN_FEATURES, 1, generator=weights) / IN_FEATURES ** 0.5
    x = torch.randn(rows, IN_FEATURES, generator=torch.Generator().manual_seed(seed))
    return {"x": x, "y": x @ w + 0.3 * torch.sin(2 * x @ v)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--train-out", required=True)
    parser.add_argument("--eval-out")
    parser.add_argument("--train-rows", type=int, default=2048)
    parser.add_argument("--eval-rows", type=int, default=256)
    args = parser.parse_args()
    splits = [(args.train_out, args.train_rows, 1)]
    if args.eval_out:
        splits.append((args.eval_out, args.eval_rows, 2))
    for path, rows, seed in splits:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        torch.save(make_rows(rows, seed), path)
        print(f"wrote {rows} rows to {path}")


if __name__ == "__main__":
    main()
