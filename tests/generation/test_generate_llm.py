"""Generation with the KV cache on the zoo's decoders, against transformers and against itself.

Tiny Qwen2 / Qwen3 / Qwen3-MoE models with random weights are written by transformers'
``save_pretrained`` and read through the project's import (``load_hf_pretrained``); batched
prompts of different lengths then decode greedily to the same tokens as transformers' own
``generate`` (which runs each prompt alone), stop token included. The log-probabilities returned
equal those of one forward pass of the model over the finished sequences (the parity rule), and
the cached path equals re-running the whole prefix at every step, greedy and sampled.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.parity_utils import assert_parity, tiny_model
from veomni.checkpoint.hf_io import load_hf_pretrained
from veomni.contract import get_model_spec
from veomni.data.packing import pack_samples
from veomni.errors import BadConfig, BadData
from veomni.generation import SamplingParams, generate

VOCAB = 101
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.1)
CASES = {
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"num_key_value_heads": 1}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"moe_intermediate_size": 32, "num_experts": 8,
                                                "num_experts_per_tok": 2, "norm_topk_prob": True}),
}
PROMPTS = [[3, 17, 29, 41, 5, 77, 12], [60, 2], [9, 33, 71, 8, 90, 14, 55, 23, 66, 1, 38, 47], [84]]
NEW_TOKENS = 12


def _imported(case: str, tmp_path):
    """(transformers' model, ours with its weights through the project's HF import)."""
    config_cls, extra = CASES[case]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config_cls(**{**COMMON, **extra}),
                                                       attn_implementation="eager")
    with torch.no_grad():  # every weight N(0, 0.2), norms 1 + N(0, 0.2): a decode that does not repeat itself
        for name, param in hf.named_parameters():
            param.copy_(torch.randn_like(param) * 0.2 + ("norm" in name))
    hf.eval().save_pretrained(tmp_path)
    arch, cfg, state = load_hf_pretrained(tmp_path)
    model = get_model_spec(arch).instantiate(cfg).eval()
    model.load_state_dict(state, strict=True)
    return hf, model


def _hf_greedy(hf, prompt: list[int], new_tokens: int, eos: int | None = None) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def forward_logprobs(model, prompts, completions) -> list[torch.Tensor]:
    """Log-probabilities of each completion's tokens from one forward over the finished sequences."""
    batch = pack_samples([p + c.tokens for p, c in zip(prompts, completions)])
    with torch.no_grad():
        logp = torch.log_softmax(model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"],
                                       batch["max_seqlen"]).float(), -1)
    out = []
    for start, prompt, done in zip(batch["cu_seqlens"].tolist(), prompts, completions):
        rows = torch.arange(start + len(prompt) - 1, start + len(prompt) - 1 + len(done.tokens))
        out.append(logp[rows, torch.tensor(done.tokens)])
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_tokens_equal_transformers_generate(case, tmp_path) -> None:
    hf, model = _imported(case, tmp_path)
    got = generate(model, PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
    want = [_hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
    assert len({tuple(w) for w in want}) == len(want) and any(len(set(w)) > 3 for w in want), "degenerate decode"
    assert [c.tokens for c in got] == want
    assert all(c.finish_reason == "length" for c in got)
    # a stop token: the 5th token of the first prompt's answer ends it there, kept, as in transformers
    stop = want[0][4]
    stopped = generate(model, PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=(stop,)))
    assert [c.tokens for c in stopped] == [_hf_greedy(hf, p, NEW_TOKENS, eos=stop) for p in PROMPTS]
    assert stopped[0].tokens[-1] == stop and stopped[0].finish_reason == "stop"
    for done in got + stopped:
        assert len(done.logprobs) == len(done.tokens)


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=NEW_TOKENS),
                                    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, top_p=0.9,
                                                   top_k=40, seed=5)], ids=["greedy", "sampled"])
def test_logprobs_equal_a_forward_over_the_finished_sequences(params, tmp_path) -> None:
    _, model = _imported("qwen3", tmp_path)
    completions = generate(model, PROMPTS, params)
    for i, (got, want) in enumerate(zip(completions, forward_logprobs(model, PROMPTS, completions))):
        assert_parity(torch.tensor(got.logprobs), want, f"prompt {i}: generation's log-probs vs a forward pass")


@pytest.mark.parametrize("arch,options", [
    ("llm", {}),
    ("llm", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    ("vwn", {}),
], ids=["dense", "moe", "vwn"])
def test_cached_generation_equals_recomputing_the_prefix(arch, options) -> None:
    model = tiny_model(arch=arch, init_std=0.2, **options)
    for params in (SamplingParams(max_new_tokens=NEW_TOKENS),
                   SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=30, top_p=0.95, seed=3)):
        cached = generate(model, PROMPTS, params, prefill_tokens=16)  # prefill in three rows
        plain = generate(model, PROMPTS, params, use_cache=False)
        assert [c.tokens for c in cached] == [c.tokens for c in plain]
        assert any(len(set(c.tokens)) > 3 for c in cached), "degenerate decode"
        for i, (a, b) in enumerate(zip(cached, plain)):
            assert_parity(torch.tensor(a.logprobs), torch.tensor(b.logprobs), f"{arch} prompt {i}")


@pytest.mark.parametrize("prefill_tokens", [8192, 16], ids=["one-prefill", "three-prefills"])
def test_n_continuations_share_one_prefill_and_equal_repeating_the_prompt(prefill_tokens: int) -> None:
    """``n`` continuations per prompt: the prompt is fed to the model once (its cache copied to the
    other ``n - 1``), yet each continuation is what generating from its own copy of the prompt gives,
    with and without the cache, and the ``n`` of a prompt are drawn independently."""
    model = tiny_model(init_std=0.2)
    fed: list[int] = []
    model.embed_tokens.register_forward_hook(lambda module, args, out: fed.append(args[0].numel()))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=30, seed=5, n=3)
    shared = generate(model, PROMPTS, params, prefill_tokens=prefill_tokens)
    decoded = sum(len(c.tokens) - 1 for c in shared)  # each sequence's first token comes from the prefill
    assert sum(fed) == sum(map(len, PROMPTS)) + decoded, "a prompt was fed more than once"
    copies = [prompt for prompt in PROMPTS for _ in range(3)]
    one_each = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=30, seed=5)
    for reference in (generate(model, copies, one_each, prefill_tokens=prefill_tokens * 3),
                      generate(model, PROMPTS, params, use_cache=False)):
        assert [c.tokens for c in shared] == [c.tokens for c in reference]
        for i, (a, b) in enumerate(zip(shared, reference)):
            assert_parity(torch.tensor(a.logprobs), torch.tensor(b.logprobs), f"sequence {i}")
    assert all(len({tuple(c.tokens) for c in shared[i:i + 3]}) > 1 for i in range(0, len(shared), 3))


def test_seeded_sampling_repeats_and_seeds_differ() -> None:
    model = tiny_model(init_std=0.2)
    draw = [[c.tokens for c in generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0, seed=s))]
            for s in (1, 1, 2)]
    assert draw[0] == draw[1] and draw[0] != draw[2]


def test_a_finished_rank_keeps_stepping_in_lockstep() -> None:
    """``lockstep`` says the other ranks are still going for 5 more forwards: this rank steps on its
    scratch slot meanwhile, and its completions are those of a run alone."""
    model = tiny_model(init_std=0.2)
    params = SamplingParams(max_new_tokens=6)
    calls = []

    def others_go_on(done: bool) -> bool:
        calls.append(done)
        return done and sum(calls) > 5

    assert generate(model, PROMPTS, params, lockstep=others_go_on) == generate(model, PROMPTS, params)
    assert calls == [False] * 6 + [True] * 6  # the prefill and 5 decode steps, then 6 scratch steps


def test_bad_requests_name_the_problem() -> None:
    with pytest.raises(BadConfig, match="temperature must be >= 0.*top_p must be in"):
        SamplingParams(temperature=-1, top_p=0)
    model = tiny_model()
    with pytest.raises(BadData, match="prompt 1 has no tokens"):
        generate(model, [[1], []], SamplingParams())
