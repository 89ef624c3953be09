"""Is this GPU machine set up right, and how fast is the project on it against the references?

    bash scripts/gpu_check.sh [--only PART,...] [--tiny] [--out DIR]

Parts, each run whatever the others did (a failure is recorded and the check goes on):

- ``cuda_tests``: the tests that only a GPU runs (``pytest -m cuda``);
- ``quickstart``: ``recipes/quickstart/tiny_llm.yaml`` through ``scripts/train.sh``, 100 steps;
  the loss must fall;
- ``llm_eager`` / ``llm_compile``: ``recipes/qwen3/qwen3_1p7b.yaml`` (Qwen3-1.7B shape, rows of
  4096 tokens, 8192 per step, bf16) through ``train.sh``, eager and ``--parallel.compile true``;
- ``llm_reference``: transformers' ``Qwen3ForCausalLM`` with the same config and the same token
  shapes (bf16 weights, sdpa, fused AdamW), in this job;
- ``dit_7800`` / ``dit_32760``: one training step of the video DiT at the Wan2.1-1.3B shape
  against diffusers' ``WanTransformer3DModel`` with the same weights (outputs compared first),
  on 7,800 and 32,760 latent tokens (the larger with full activation checkpointing on both);
- ``moe``: a small Qwen3-MoE (hidden 1024, 12 layers, 64 experts top-8, expert ffn 768) against
  transformers' ``Qwen3MoeForCausalLM`` with the same weights.

Each prints tokens/s, MFU (the project's FLOPs formulas over the GPU's dense bf16 peak), peak
memory and ours / reference; everything goes to ``DIR/report.json``. ``--tiny`` shrinks every
shape and step count so the whole check runs on a CPU in a few minutes (a smoke test of the check
itself, no figures). Nothing is downloaded: models are built from configs with random weights.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _gpu_check_models import dit_step, llm_reference, moe_pair  # noqa: E402

from veomni.train.report.metrics import device_peak_flops  # noqa: E402

PARTS = ("cuda_tests", "quickstart", "llm_eager", "llm_compile", "llm_reference", "dit_7800", "dit_32760", "moe")
LLM_RECIPE = REPO / "recipes" / "qwen3" / "qwen3_1p7b.yaml"
QUICKSTART = REPO / "recipes" / "quickstart" / "tiny_llm.yaml"
# --tiny: the same recipes through the same code, at sizes a CPU takes in seconds
TINY_LLM = ["--model.vocab_size", "8192", "--model.hidden_size", "64", "--model.intermediate_size", "128",
            "--model.num_layers", "2", "--model.num_heads", "4", "--model.num_kv_heads", "2", "--model.head_dim", "16",
            "--data.max_seq_len", "256", "--data.tokens_per_micro_batch", "512"]


def _train_sh(recipe: Path, out: Path, steps: int, extra: list[str], timeout_s: float) -> list[dict]:
    """Run ``scripts/train.sh`` on one process; return its per-step metrics records."""
    cmd = ["bash", str(REPO / "scripts" / "train.sh"), str(recipe), "--train.max_steps", str(steps),
           "--train.output_dir", str(out), "--checkpoint.interval", "0", "--checkpoint.save_final", "false",
           "--checkpoint.resume", "none", "--train.eval_interval", "0", "--train.sample_interval", "0",
           "--log.interval", "1", "--log.progress_bar", "false", *extra]
    env = {**os.environ, "NPROC_PER_NODE": "1"}
    returncode, _, stderr = _run_group(cmd, env, timeout_s)
    if returncode != 0:
        raise RuntimeError(f"train.sh exited {returncode}:\n{stderr[-3000:]}")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "step" in r and "mfu" in r]


def _run_group(cmd: list[str], env: dict, timeout_s: float) -> tuple[int, str, str]:
    """Run ``cmd`` in its own process group; past ``timeout_s`` the whole group (torchrun and its
    workers too) is killed and the part fails, so the next part starts on an idle GPU."""
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise TimeoutError(f"{' '.join(cmd[:3])} ran past the part's budget of {timeout_s:.0f} s") from None
    return proc.returncode, stdout, stderr


def _steady(records: list[dict], key: str, skip: int) -> float:
    values = [r[key] for r in records if r["step"] > skip] or [r[key] for r in records]
    return statistics.median(values)


def part_cuda_tests(args) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:randomly", "tests"]
    returncode, stdout, _ = _run_group(cmd, dict(os.environ), args.budget)
    summary = (stdout.strip().splitlines() or ["(no output)"])[-1]
    if returncode not in (0, 5):  # 5: none collected
        raise RuntimeError(f"pytest -m cuda: {summary}\n{stdout[-3000:]}")
    return {"summary": summary}


def part_quickstart(args) -> dict:
    steps = 30 if args.tiny else 100
    records = _train_sh(QUICKSTART, args.out / "quickstart", steps, [], args.budget)
    first, last = records[0]["loss"], statistics.mean(r["loss"] for r in records[-5:])
    if not last < first - 0.5:
        raise RuntimeError(f"the quick start's loss did not fall: {first:.3f} at step 1, {last:.3f} at the end")
    return {"loss_first": first, "loss_last": last, "steps": len(records)}


def _llm_through_train_sh(args, compile_: bool) -> dict:
    steps = 8 if args.tiny else 30
    extra = (TINY_LLM if args.tiny else []) + (["--parallel.compile", "true"] if compile_ else [])
    records = _train_sh(LLM_RECIPE, args.out / ("llm_compile" if compile_ else "llm_eager"), steps, extra,
                        args.budget)
    return {"tokens_per_s": _steady(records, "tokens_per_s", 5), "mfu": _steady(records, "mfu", 5),
            "peak_mem_gb": max(r["peak_mem_gb"] for r in records), "steps": len(records)}


def part_llm_eager(args) -> dict:
    return _llm_through_train_sh(args, compile_=False)


def part_llm_compile(args) -> dict:
    return _llm_through_train_sh(args, compile_=True)


def part_llm_reference(args) -> dict:
    return llm_reference(args.device, args.tiny, args.peak)


def part_dit_7800(args) -> dict:
    return dit_step(args.device, args.tiny, args.peak, frames=5, checkpointing=False)


def part_dit_32760(args) -> dict:
    return dit_step(args.device, args.tiny, args.peak, frames=21, checkpointing=True)


def part_moe(args) -> dict:
    return moe_pair(args.device, args.tiny, args.peak)


def ratios(results: dict) -> dict:
    """ours / reference for each pair the check times (tokens/s; > 1 is faster than the reference)."""
    out = {}
    ref = results.get("llm_reference", {})
    for part in ("llm_eager", "llm_compile"):
        if "tokens_per_s" in results.get(part, {}) and "tokens_per_s" in ref:
            out[f"{part} / transformers"] = results[part]["tokens_per_s"] / ref["tokens_per_s"]
            out[f"{part} MFU / transformers MFU"] = results[part]["mfu"] / ref["mfu"]
    for part in ("dit_7800", "dit_32760", "moe"):
        if "ours" in results.get(part, {}):
            out[f"{part} ours / reference"] = results[part]["reference"]["step_s"] / results[part]["ours"]["step_s"]
    return out


def _print_table(results: dict) -> None:
    print(f"\n{'part':<14} {'status':<7} {'tokens/s':>12} {'MFU':>7} {'peak GB':>8}  note")
    for part, result in results.items():
        rows = [(part, result)] if "ours" not in result else [
            (f"{part} ours", result["ours"]), (f"{part} ref", result["reference"])]
        for name, row in rows:
            status = "ok" if "error" not in result else "FAILED"
            tps = f"{row['tokens_per_s']:,.0f}" if "tokens_per_s" in row else ""
            mfu = f"{row['mfu']:.3f}" if "mfu" in row else ""
            mem = f"{row['peak_mem_gb']:.1f}" if "peak_mem_gb" in row else ""
            note = result.get("error", "").splitlines()[0][:60] if "error" in result else row.get("summary", "")
            print(f"{name:<14} {status:<7} {tps:>12} {mfu:>7} {mem:>8}  {note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU smoke test of the check itself")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "gpu_check")
    parser.add_argument("--budget", type=float, default=420, help="seconds one part may take")
    args = parser.parse_args()
    unknown = set(args.only.split(",")) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.peak, peak_source = device_peak_flops(args.device)
    machine = {"device": torch.cuda.get_device_name() if args.device.type == "cuda" else "cpu",
               "torch": torch.__version__, "cuda": torch.version.cuda, "peak": peak_source,
               "date": datetime.date.today().isoformat(), "tiny": args.tiny}
    print(f"[gpu_check] {machine}", flush=True)
    results: dict[str, dict] = {}
    for part in (p for p in PARTS if p in args.only.split(",")):
        start = time.perf_counter()
        try:
            results[part] = globals()[f"part_{part}"](args)
        except Exception as exc:  # noqa: BLE001  (the check keeps going; the report says what failed)
            results[part] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        results[part]["seconds"] = round(time.perf_counter() - start, 1)
        verdict = "FAILED " + results[part]["error"].splitlines()[0] if "error" in results[part] else "ok"
        print(f"[gpu_check] {part}: {verdict} ({results[part]['seconds']} s)", flush=True)
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    report = {"machine": machine, "results": results, "ratios": ratios(results)}
    (args.out / "report.json").write_text(json.dumps(report, indent=2))
    _print_table(results)
    for name, value in report["ratios"].items():
        print(f"{name:<40} {value:.2f}")
    failed = [p for p, r in results.items() if "error" in r]
    print(f"\n[gpu_check] report: {args.out / 'report.json'}; "
          f"{'all parts ran' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
