"""``train.objective: grpo``: the GRPO task, the built-in rollout engine and the rollout feed,
put together and registered (docs/post_training.md, online RL).

The trainer sees an ``Objective`` like any other: a task (``GRPOTask``), an ``attach`` that takes
the policy (and the reference when ``rl.kl_coef > 0``), and a ``feed`` that turns the data kind's
prompt micro-batches (``chat_prompts``; ``chat_media_prompts`` for a VLM, generated and packed with
the model's ``MediaLayout``) into rollout rows (``RolloutFeed``, generating with the engine
``rl.rollout_engine`` names: by default ``PolicyEngine``, the trained model in the training
processes; ``rollout_engines.py``). Held-out prompts are scored by ``scripts/eval_chat.sh``
(``scripts/eval_vqa.sh`` for media prompts), not by the task's loss (``evaluates=False``).
"""

from __future__ import annotations

from torch import nn

from veomni.config.schema import RunConfig
from veomni.objectives import vllm_engine as vllm_engine  # registers the vllm engine
from veomni.objectives.grpo import GRPOTask
from veomni.objectives.grpo_loss import GRPOOptions
from veomni.objectives.registry import FeedRequest, FrozenModels, Objective, ObjectiveRequest, register_objective
from veomni.objectives.rewards import reward_problems
from veomni.objectives.rollout_engines import EngineRequest, build_rollout_engine, rollout_engine_problems
from veomni.objectives.rollout_feed import RolloutFeed
from veomni.objectives.sequence_logps import LogitsTask

MEDIA_PROMPTS = ("chat_media_prompts",)
"""The data kinds whose prompts are chats with media, generated and trained with the model's layout."""


def build_grpo(request: ObjectiveRequest) -> Objective:
    inner = request.task
    if not isinstance(inner, LogitsTask):
        raise ValueError("train.objective=grpo needs a task that gives token logits (a LogitsTask: language "
                         f"modelling, VLM); the family's task {type(inner).__name__} does not")
    rl = request.cfg.rl
    options = GRPOOptions(rl.clip_low, rl.clip_high, rl.aggregation, rl.kl_coef, rl.kl_estimator, rl.max_new_tokens)
    task = GRPOTask(inner, options)
    policy: list[nn.Module] = []

    def attach(models: FrozenModels) -> None:
        policy.append(models.policy)
        task.attach(models, rl.kl_coef > 0)

    def feed(feed_request: FeedRequest) -> RolloutFeed:
        layout = feed_request.model_config.media_layout() if request.cfg.data.kind in MEDIA_PROMPTS else None
        engine = build_rollout_engine(EngineRequest(request.cfg, policy[0], feed_request.device,
                                                    feed_request.lockstep_group, feed_request.tokenizer, layout))
        return RolloutFeed(feed_request, rl, engine, policy[0], layout)

    return Objective("grpo", task, attach, feed=feed, evaluates=False)


def grpo_problems(cfg: RunConfig) -> list[str]:
    """The launcher's checks: the rewards load, the rollout engine is registered and can run here."""
    return reward_problems(cfg) + rollout_engine_problems(cfg)


def grpo_reference_copies(cfg: RunConfig) -> int:
    """The frozen reference: held only for the KL penalty."""
    return int(cfg.rl.kl_coef > 0)


register_objective("grpo", build_grpo, frozen_copies=grpo_reference_copies,
                   data_kinds=("chat_prompts", *MEDIA_PROMPTS), checks=grpo_problems, rollouts=True)
