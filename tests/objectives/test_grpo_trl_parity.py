"""The GRPO family against TRL 1.16's ``GRPOTrainer._compute_loss``, which this project did not write:
on a tiny random Qwen3 built from a transformers config and the same fixed rollouts (prompts,
completions, rewards), our loss, gradients, clip fraction, KL and entropy equal TRL's, for GRPO
(``loss_type="grpo"``: seq-mean-token-mean), DAPO (``dapo``: token-mean, clip-higher) and Dr. GRPO
(``dr_grpo``: seq-mean-token-sum-norm, advantages without the std), with the k3 KL to a reference.

Two updates of one rollout batch: the first at the rollout weights (ratio 1, TRL's ``old`` = the
forward's own log-probabilities), an SGD step on both sides, then the second with TRL given the
first weights' log-probabilities as ``old_per_token_logps`` and ours keeping them itself (by the
micro-batch's ``rollout_key``), so the clip acts. TRL's side is its own trainer, its own fused LM
head (``add_fused_lm_head``) and loss; the advantages are the published GRPO / Dr. GRPO formula
with TRL's ``nanstd``. The KL term is GRPO's (and verl's ``use_kl_loss``): TRL's default
``use_bias_correction_kl`` (the KL weighted by the ratio, DeepSeek-V3.2) is turned off.
A planted change of the clip range or the advantage normalisation fails.
"""

from __future__ import annotations

from types import SimpleNamespace

import datasets  # trl's, a dev dependency: imported, never skipped (docs/testing.md)
import pytest
import torch
import transformers
import trl
from trl.trainer.utils import add_fused_lm_head, nanstd

from tests.chat_utils import write_chat_tokenizer
from tests.objectives.test_trl_parity import _hf_grads, _hf_qwen3, _ours
from tests.parity_utils import assert_grads_parity, assert_scalar_parity
from veomni.config.schema import RunConfig
from veomni.objectives import FrozenModels, ObjectiveRequest, build_objective
from veomni.objectives.grpo import ROLLOUT_KEY
from veomni.objectives.grpo_loss import group_advantages
from veomni.objectives.rollout import pack_rollouts
from veomni.tasks.lm import LanguageModelingTask

GROUP, MAX_NEW = 3, 7
PROMPTS = [[5, 17, 230, 31, 9], [77, 8, 1000, 4, 12]]
"""Two prompts of one length (TRL left-pads prompts; equal lengths keep its positions ours)."""
COMPLETIONS = [[40, 41, 42], [43, 44, 45, 46, 47, 48], [49, 50], [60, 61, 62, 63], [64], [65, 66, 67, 68, 69, 70, 71]]
REWARDS = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0])
LR = 2.0
"""A large SGD step, so the second update's ratios leave the clip range."""

VARIANTS = {
    "grpo": dict(aggregation="seq-mean-token-mean", scale_rewards=True, clip_low=0.2, clip_high=0.2, kl_coef=0.05),
    "dapo": dict(aggregation="token-mean", scale_rewards=True, clip_low=0.2, clip_high=0.28, kl_coef=0.0),
    "dr_grpo": dict(aggregation="seq-mean-token-sum-norm", scale_rewards=False, clip_low=0.1, clip_high=0.3,
                    kl_coef=0.05),
}


def published_advantages(rewards: torch.Tensor, scale: bool) -> torch.Tensor:
    """GRPO's group-normalised advantage (Dr. GRPO without the std), TRL's eps and unbiased ``nanstd``."""
    grouped = rewards.view(-1, GROUP)
    centred = rewards - grouped.mean(1).repeat_interleave(GROUP)
    return centred / (nanstd(grouped, dim=1).repeat_interleave(GROUP) + 1e-4) if scale else centred


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(write_chat_tokenizer(tmp / "tokenizer")))
    args = trl.GRPOConfig(output_dir=str(tmp / "out"), report_to=[], use_cpu=True, bf16=False, beta=0.0,
                          per_device_train_batch_size=GROUP * 2, num_generations=GROUP,
                          max_completion_length=MAX_NEW, use_bias_correction_kl=False)
    out = trl.GRPOTrainer(model=_hf_qwen3(0), reward_funcs=lambda completions, **_: [0.0] * len(completions),
                          args=args, train_dataset=datasets.Dataset.from_list([{"prompt": "x"}] * 2),
                          processing_class=tokenizer)
    out.current_gradient_accumulation_steps = 1
    return out


def _trl_inputs(old: torch.Tensor | None, ref: torch.Tensor, advantages: torch.Tensor) -> dict:
    width = max(len(c) for c in COMPLETIONS)
    completion = torch.zeros(len(COMPLETIONS), width, dtype=torch.long)
    mask = torch.zeros(len(COMPLETIONS), width, dtype=torch.long)
    for i, c in enumerate(COMPLETIONS):
        completion[i, :len(c)], mask[i, :len(c)] = torch.tensor(c), 1
    prompt = torch.tensor([p for p in PROMPTS for _ in range(GROUP)])
    return {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
            "completion_mask": mask, "advantages": advantages, "old_per_token_logps": old,
            "ref_per_token_logps": ref, "num_items_in_batch": mask.sum()}


def _trl_run(trainer, loss_type: str, variant: dict) -> SimpleNamespace:
    trainer.loss_type, trainer.beta = loss_type, variant["kl_coef"]
    trainer.epsilon_low, trainer.epsilon_high = variant["clip_low"], variant["clip_high"]
    policy, reference = _hf_qwen3(0), _hf_qwen3(1)
    for model in (policy, reference):
        add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    trainer.model = policy
    advantages = published_advantages(REWARDS, variant["scale_rewards"])
    inputs = _trl_inputs(None, None, advantages)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        old = trainer._get_per_token_logps_and_entropies(policy, ids, attention, ids.size(1) - len(PROMPTS[0]))[0]
        ref = trainer._get_per_token_logps_and_entropies(reference, ids, attention, ids.size(1) - len(PROMPTS[0]))[0]
    record = []
    for update in range(2):
        trainer._metrics["train"].clear()
        policy.zero_grad()
        loss = trainer._compute_loss(policy, _trl_inputs(old if update else None, ref, advantages))
        loss.backward()
        metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
        record.append(SimpleNamespace(loss=float(loss.detach()), grads=_hf_grads(policy), metrics=metrics))
        with torch.no_grad():
            for p in policy.parameters():
                p -= LR * p.grad
    return record


def our_run(variant: dict, planted: dict | None = None) -> list[SimpleNamespace]:
    cfg = RunConfig()
    cfg.train.objective = "grpo"
    for key, value in {**variant, **(planted or {})}.items():
        setattr(cfg.rl, key, value)
    cfg.rl.group_size, cfg.rl.max_new_tokens = GROUP, MAX_NEW
    found = build_objective(ObjectiveRequest(cfg, LanguageModelingTask()))
    policy, frozen = _ours(_hf_qwen3(0)), _ours(_hf_qwen3(1)).requires_grad_(False)
    found.attach(FrozenModels(policy, lambda: frozen, False, None))
    advantages = group_advantages(REWARDS, GROUP, scale=cfg.rl.scale_rewards)
    prompts = [p for p in PROMPTS for _ in range(GROUP)]
    batch = {**found.task.prepare(pack_rollouts(prompts, COMPLETIONS, advantages.tolist())), ROLLOUT_KEY: (0, 0)}
    record = []
    for _ in range(2):
        policy.zero_grad()
        out = found.task(policy, batch)
        (out.loss_sum / out.loss_units).backward()
        metrics = {name: float(value) / count for name, (value, count) in out.metrics.items()}
        record.append(SimpleNamespace(loss=float(out.loss_sum) / out.loss_units, metrics=metrics,
                                      grads={name: p.grad.clone() for name, p in policy.named_parameters()}))
        with torch.no_grad():
            for p in policy.parameters():
                p -= LR * p.grad
    return record


def test_group_advantages_equal_the_published_formula() -> None:
    for scale in (True, False):
        assert_scalar_parity(0.0, float((group_advantages(REWARDS, GROUP, scale)
                                         - published_advantages(REWARDS, scale)).abs().max()), "advantages")
    with pytest.raises(ValueError, match="groups of 4"):
        group_advantages(REWARDS, 4)


@pytest.mark.parametrize("loss_type", [name if name == "grpo" else pytest.param(name, marks=pytest.mark.full)
                                       for name in sorted(VARIANTS)])
def test_grpo_variants_equal_trl_grpo_trainer(trainer, loss_type: str) -> None:
    variant = VARIANTS[loss_type]
    theirs, ours = _trl_run(trainer, loss_type, variant), our_run(variant)
    assert theirs[1].metrics["clip_ratio/region_mean"] > 0.05, "the second update's ratios leave the clip range"
    for update, (mine, want) in enumerate(zip(ours, theirs)):
        what = f"{loss_type} update {update}"
        assert_scalar_parity(mine.loss, want.loss, f"{what} loss")
        assert_grads_parity(mine.grads, want.grads, f"{what} gradients")
        assert_scalar_parity(mine.metrics["clip_fraction"], want.metrics["clip_ratio/region_mean"], f"{what} clip")
        assert_scalar_parity(mine.metrics["entropy"], want.metrics["entropy"], f"{what} entropy")
        if variant["kl_coef"]:
            assert_scalar_parity(mine.metrics["kl"], want.metrics["kl"], f"{what} kl")


@pytest.mark.full
def test_a_changed_clip_or_advantage_normalisation_breaks_parity(trainer) -> None:
    variant = VARIANTS["grpo"]
    theirs = _trl_run(trainer, "grpo", variant)
    for planted in ({"clip_high": 0.25}, {"clip_low": 0.15}, {"scale_rewards": False}):
        ours = our_run(variant, planted)[-1]
        with pytest.raises(AssertionError):
            assert_scalar_parity(ours.loss, theirs[-1].loss, f"planted {planted} loss")
            assert_grads_parity(ours.grads, theirs[-1].grads, f"planted {planted} gradients")
