"""The command shell the held-out answer evals share (``vqa.py``, ``chat_exact_match.py``): a run
folder, an optional checkpoint, the split, a limit, the answer length, an optional JSON copy of the
result; errors about missing or bad inputs end in one line and status 2."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from veomni.logging_setup import setup_logging


def run_eval_command(argv: list[str] | None, prog: str, description: str, items: str, default_tokens: int,
                     tokens_help: str, evaluate: Callable[..., dict[str, Any]],
                     format_result: Callable[[dict[str, Any]], str]) -> int:
    """Parse ``argv``, call ``evaluate(run_dir, checkpoint, split, limit, max_answer_tokens)``, print
    ``format_result`` of its result (and write it as JSON with ``--json``); ``items`` names what
    ``--limit`` counts."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path, help="the run's train.output_dir")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a step_* folder (default: the newest)")
    parser.add_argument("--split", choices=("eval", "train"), default="eval")
    parser.add_argument("--limit", type=int, default=None, help=f"evaluate only the first N {items}")
    parser.add_argument("--max-answer-tokens", type=int, default=default_tokens, help=tokens_help)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args(argv)
    if args.max_answer_tokens < 1:
        parser.error(f"--max-answer-tokens must be at least 1, got {args.max_answer_tokens}")
    setup_logging()
    try:
        result = evaluate(args.run_dir, args.checkpoint, args.split, args.limit, args.max_answer_tokens)
    except (FileNotFoundError, ValueError) as exc:
        print(f"eval error: {exc}", file=sys.stderr)
        return 2
    print(format_result(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
