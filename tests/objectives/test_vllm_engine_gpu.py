"""The vLLM rollout engine on a GPU with vllm installed (``pytest -m cuda``; skipped elsewhere).

A tiny random Qwen3 in fp32 on the GPU: after ``sync_weights`` the engine's greedy tokens equal the
built-in engine's (``veomni.generation.generate`` on the trained model) and its log-probabilities
are close (another attention kernel), and ``n`` samples per prompt come back prompt by prompt, drawn
apart; then the weights change, as an update changes them, and after
the next ``sync_weights`` the engine generates with the new ones (equal to the built-in engine
again, and not the tokens of before). vLLM's ``external_launcher`` runs inside a torchrun process,
so the check runs as one: this module's ``__main__``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install vllm)")]
REPO = Path(__file__).resolve().parents[2]
OPTIONS = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
               head_dim=64, max_position_embeddings=256, family="qwen3", qk_norm=True)
PROMPTS = [[3, 14, 15, 92], [6, 5], [35, 89, 79, 32, 38]]


def test_vllm_generates_like_the_builtin_engine_and_with_the_pushed_weights() -> None:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                             str(Path(__file__))], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "vllm engine: checked" in result.stdout


def _check() -> None:
    import torch.distributed as dist

    from veomni.config.schema import RunConfig
    from veomni.contract import build_model, load_plugins
    from veomni.generation import SamplingParams, generate
    from veomni.objectives.rollout_engines import EngineRequest
    from veomni.objectives.vllm_engine import build_vllm_engine

    load_plugins()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("cuda:nccl,cpu:gloo")
    torch.manual_seed(0)
    _, model = build_model("llm", OPTIONS)
    model.init_weights()
    model.to(device).eval()
    cfg = RunConfig()
    cfg.model.arch, cfg.model.options = "llm", dict(OPTIONS)
    cfg.train.output_dir, cfg.parallel.mixed_precision = tempfile.mkdtemp(), "fp32"
    cfg.data.max_seq_len, cfg.rl.max_new_tokens = 64, 12
    engine = build_vllm_engine(EngineRequest(cfg, model, device, None, None))
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)

    def tokens_after_sync() -> list[list[int]]:
        engine.sync_weights(model)
        got = engine.generate(PROMPTS, greedy)
        engine.release()
        want = generate(model, PROMPTS, greedy)
        assert [c.tokens for c in got] == [c.tokens for c in want], "greedy tokens differ from the built-in engine"
        for mine, theirs in zip(got, want):
            torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-3, rtol=0)
        return [c.tokens for c in got]

    before = tokens_after_sync()
    engine.sync_weights(model)
    groups = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, temperature=1.0, seed=0, n=3))
    engine.release()
    assert len(groups) == 3 * len(PROMPTS), "n samples per prompt, prompt by prompt"
    assert all(len({tuple(c.tokens) for c in groups[i:i + 3]}) > 1 for i in range(0, len(groups), 3)), \
        "the samples of a prompt are drawn apart"
    with torch.no_grad():  # an update: every weight moves
        for param in model.parameters():
            param.add_(torch.randn_like(param), alpha=0.5)
    assert tokens_after_sync() != before, "the engine still generates with the weights of before"
    print("vllm engine: checked")
    dist.destroy_process_group()


if __name__ == "__main__":
    _check()
