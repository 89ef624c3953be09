"""Entry point of ``scripts/chat.sh``: a conversation with a trained run on the terminal.

Each line read is a user turn; the run's answer is printed and kept in the conversation, so the
next turn sees it ("/reset" forgets it). ``--image FILE`` shows a model with an image encoder an
image with the first turn (an ``<image>`` marker goes before that turn's text)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from veomni.generation import SamplingParams
from veomni.inference import RunChat


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/chat.sh", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="the run's train.output_dir")
    parser.add_argument("--checkpoint", type=Path, default=None, help="a step folder (default: the newest)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image", type=Path, default=None, help="an image file shown with the first turn")
    parser.add_argument("--system", default=None, help="a system turn to start every conversation")
    return parser.parse_args(argv)


def main(argv: list[str], lines=sys.stdin, out=sys.stdout) -> int:
    args = parse(argv)
    chat = RunChat(args.run_dir, args.checkpoint)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    start = [{"role": "system", "content": args.system}] if args.system else []
    media = {args.image.suffix.lstrip(".").lower(): args.image.read_bytes()} if args.image else None
    messages = list(start)
    for line in lines:
        text = line.strip()
        if not text:
            break
        if text == "/reset":
            messages = list(start)
            continue
        first = not any(m["role"] == "user" for m in messages)
        if first and media:
            text = f"<image>\n{text}"
        messages.append({"role": "user", "content": text})
        answer = chat.reply(messages, params, media)  # the whole chat is read again: its image too
        messages.append({"role": "assistant", "content": answer})
        print(answer, file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
