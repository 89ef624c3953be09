"""The rollout pieces of ``train.objective: grpo``: the built-in engine's batched decoding against
each prompt decoded alone without the cache, its log-probabilities against a forward pass of the
finished sequences, rewards loaded by dotted path, and the packed rollout rows."""

from __future__ import annotations

import pytest
import torch

from tests.parity_utils import assert_scalar_parity, tiny_model
from veomni.config.schema import RunConfig
from veomni.generation import generate
from veomni.objectives.grpo import ADVANTAGES
from veomni.objectives.rewards import Rewards, exact_match, format_match, load_reward, reward_problems
from veomni.objectives.rollout import PolicyEngine, SamplingParams, pack_rollouts
from veomni.tasks.base import IGNORE_INDEX

PROMPTS = [[3, 14, 15, 92], [6, 5], [35, 89, 79, 32, 38]]


def test_greedy_packed_decoding_equals_one_sequence_decoding_and_its_logprobs_a_forward() -> None:
    model = tiny_model(0)
    engine = PolicyEngine(model, torch.device("cpu"), None)
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=0.0))
    for prompt, completion in zip(PROMPTS, out):
        alone = generate(model, [prompt], SamplingParams(max_new_tokens=4), use_cache=False)[0]
        assert completion.tokens == alone.tokens
        ids = prompt + completion.tokens
        n = len(ids)
        with torch.no_grad():
            logps = torch.log_softmax(model(torch.tensor(ids), torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                                            n).float(), -1)
        for i, (token, logp) in enumerate(zip(completion.tokens, completion.logprobs)):
            assert_scalar_parity(logp, float(logps[len(prompt) + i - 1, token]), f"logprob of token {i}")


def test_sampling_is_seeded_and_stops_at_a_stop_token() -> None:
    engine = PolicyEngine(tiny_model(0), torch.device("cpu"), None)
    params = SamplingParams(max_new_tokens=5, temperature=1.0, top_p=0.9, top_k=20, seed=7)
    first, again = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert [c.tokens for c in first] == [c.tokens for c in again]
    other = engine.generate(PROMPTS, SamplingParams(5, 1.0, 0.9, 20, seed=8))
    assert [c.tokens for c in first] != [c.tokens for c in other]
    stop = first[0].tokens[2]
    stopped = engine.generate(PROMPTS, SamplingParams(5, 1.0, 0.9, 20, (stop,), seed=7))[0]
    assert stopped.tokens == first[0].tokens[:first[0].tokens.index(stop) + 1] and stopped.finish_reason == "stop"


def test_rewards_load_by_dotted_path_and_sum_with_weights() -> None:
    assert exact_match("  12  34 ", {"answer": "12 34"}) == 1.0 and exact_match("1234", {"answer": "12 34"}) == 0.0
    assert format_match(" 42\n", {"format": r"-?\d+"}) == 1.0 and format_match("42 apples", {"format": r"\d+"}) == 0.0
    assert load_reward("veomni.objectives.rewards.exact_match") is exact_match
    rewards = Rewards(["veomni.objectives.rewards.exact_match", "veomni.objectives.rewards.format_match"], [1.0, 0.5])
    metas = [{"answer": "7", "format": r"\d+"}] * 3
    assert rewards(["7", "8", "x"], metas).tolist() == [1.5, 0.5, 0.0]
    cfg = RunConfig()
    cfg.rl.rewards = ["veomni.objectives.rewards.no_such", "exact_match"]
    problems = reward_problems(cfg)
    assert len(problems) == 2 and "no_such" in problems[0] and "dotted path" in problems[1]
    with pytest.raises(ValueError, match="cannot load"):
        load_reward("no_such_package.fn")


def test_rollout_rows_carry_targets_on_completions_and_each_samples_advantage() -> None:
    batch = pack_rollouts([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]], [0.5, -1.0])
    assert batch["input_ids"].tolist() == [1, 2, 3, 6, 7, 4, 5, 8, 9, 10]
    assert batch["labels"].tolist() == [IGNORE_INDEX, IGNORE_INDEX, 6, 7, IGNORE_INDEX,
                                        IGNORE_INDEX, 8, 9, 10, IGNORE_INDEX]
    assert batch[ADVANTAGES].tolist() == [0.5] * 5 + [-1.0] * 5


def test_the_launcher_checks_name_a_bad_reward_and_the_wrong_data_kind() -> None:
    from veomni.objectives import objective_problems

    cfg = RunConfig()
    cfg.train.objective = "grpo"
    assert objective_problems(cfg, "chat_prompts") == []
    assert "chat_prompts" in objective_problems(cfg, "chat_text")[0]
    cfg.rl.rewards = ["veomni.objectives.rewards.exact_matc"]
    assert "cannot load 'veomni.objectives.rewards.exact_matc'" in objective_problems(cfg, "chat_prompts")[0]
