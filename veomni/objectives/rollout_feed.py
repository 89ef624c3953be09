"""The RL loop's data side: prompts in, rollout rows out, one optimizer step at a time.

The trainer asks its feed for each step's micro-batches and knows nothing more. The GRPO
objective's feed (``RolloutFeed``) wraps the run's feed of prompt micro-batches (the
``chat_prompts`` kind, or ``chat_media_prompts``: chats with images and videos, whose media the
rollout rows carry so the update's forward sees them, as generation did): every
``rl.updates_per_rollout`` steps it takes the next step's prompt
micro-batches, has the engine sample ``rl.group_size`` completions of each prompt with the
current (just trained) weights, scores them with the rewards, turns the rewards into group
advantages and packs each prompt micro-batch's completions into one rollout row
(``pack_rollouts``), tagged with its ``rollout_key``; the steps between rollouts get the same rows
again (the task keeps their first log-probabilities as ``old``).

A group is generated, scored and normalised on the rank that holds its prompt; ranks sharing a
row (sequence parallelism) hold the same prompts and draw the same completions (the sampling seed
comes from the seed, the rollout and the data-parallel rank). Metrics of each rollout, over the
data-parallel ranks: ``reward_mean``, ``reward_std``, ``accuracy`` (the share of completions whose
first reward is 1, e.g. an exact match), ``response_length`` (mean tokens), ``rollout_tokens_per_s``
(generated tokens of the run over the slowest rank's generation time), ``rollout_time_s``,
``rollout_peak_mem_gb`` and ``finished`` (the share that ended at a stop token); of each step's update,
``update_time_s`` and ``update_peak_mem_gb``. The engine is told to ``release`` its device memory
once a rollout is done.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from veomni.config.objective_settings import RLConfig
from veomni.contract.media import MediaLayout
from veomni.objectives.grpo import ROLLOUT_KEY
from veomni.objectives.grpo_loss import group_advantages
from veomni.objectives.registry import FeedRequest
from veomni.objectives.rewards import Rewards
from veomni.objectives.rollout import RolloutEngine, SamplingParams, pack_rollouts


def _peak_memory_gb(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


class RolloutFeed:
    def __init__(self, request: FeedRequest, rl: RLConfig, engine: RolloutEngine, policy: nn.Module,
                 layout: MediaLayout | None = None) -> None:
        """``layout``: the model's, for prompts with media (None: token prompts)."""
        self.request, self.rl, self.engine, self.policy, self.layout = request, rl, engine, policy, layout
        self.rewards = Rewards(rl.rewards, rl.reward_weights)
        tokenizer = request.tokenizer
        self.stop = tuple(sorted({tokenizer.eos_token_id, *tokenizer.all_special_ids} - {None}))
        self.step = request.start_step
        self.rows: list[dict[str, Any]] = []
        self.metrics: dict[str, float] = {}
        self.update_started = time.perf_counter()

    def next_step(self) -> list[dict[str, Any]]:
        if self.step % self.rl.updates_per_rollout == 0 or not self.rows:
            self.rows = self.rollout(self.step // self.rl.updates_per_rollout)
        self.step += 1
        if self.request.device.type == "cuda":  # the update's own peak from here on
            torch.cuda.reset_peak_memory_stats(self.request.device)
        self.update_started = time.perf_counter()
        return [dict(row) for row in self.rows]

    def rollout(self, index: int) -> list[dict[str, Any]]:
        synced = time.perf_counter()
        self.engine.sync_weights(self.policy)  # the reshard: nothing for the built-in engine
        reshard = time.perf_counter() - synced
        prompt_batches = self.request.feed.next_step()
        if self.request.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.request.device)
        started = time.perf_counter()
        rows, rewards, firsts, lengths, stopped = [], [], [], [], 0
        group = self.rl.group_size
        for mb, batch in enumerate(prompt_batches):
            prompts = [prompt for prompt in batch["prompts"] for _ in range(group)]
            metas = [meta for meta in batch["metas"] for _ in range(group)]
            seed = hash((self.request.seed, index, mb, self.request.dp_rank)) % 2**31
            params = SamplingParams(self.rl.max_new_tokens, self.rl.temperature, self.rl.top_p, self.rl.top_k,
                                    self.stop, seed, n=group)
            completions = self.engine.generate(batch["prompts"], params)  # a group shares its prompt's prefill
            texts = [self.request.tokenizer.decode(c.tokens, skip_special_tokens=True) for c in completions]
            scores = self.rewards(texts, metas)
            first = torch.tensor([float(self.rewards.fns[0](t, m)) for t, m in zip(texts, metas)])
            advantages = group_advantages(scores, group, self.rl.scale_rewards)
            rows.append({**pack_rollouts(prompts, [c.tokens for c in completions], advantages.tolist(), self.layout),
                         ROLLOUT_KEY: (index, mb)})
            rewards.append(scores)
            firsts.append(first)
            lengths += [len(c.tokens) for c in completions]
            stopped += sum(c.finish_reason == "stop" for c in completions)
        elapsed = time.perf_counter() - started
        self.engine.release()
        self.metrics = self._reduce(torch.cat(rewards), torch.cat(firsts), lengths, stopped, elapsed, reshard)
        return rows

    def _reduce(self, rewards: torch.Tensor, firsts: torch.Tensor, lengths: list[int], stopped: int,
                elapsed: float, reshard: float) -> dict[str, float]:
        sums = torch.tensor([float(len(rewards)), float(rewards.sum()), float((rewards ** 2).sum()),
                             float((firsts == 1).sum()), float(sum(lengths)), float(stopped)], dtype=torch.float64)
        slowest = torch.tensor([elapsed, _peak_memory_gb(self.request.device), reshard], dtype=torch.float64)
        group = self.request.metrics_group
        if group is not None:
            dist.all_reduce(sums, group=group)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        n, total, squares, right, tokens, ended = sums.tolist()
        mean = total / n
        return {"reward_mean": mean, "reward_std": max(squares / n - mean ** 2, 0.0) ** 0.5, "accuracy": right / n,
                "response_length": tokens / n, "finished": ended / n, "rollout_time_s": float(slowest[0]),
                "rollout_tokens_per_s": tokens / max(float(slowest[0]), 1e-9),
                "rollout_peak_mem_gb": float(slowest[1]), "reshard_time_s": float(slowest[2])}

    def step_metrics(self) -> dict[str, float]:
        """The prompt feed's, the last rollout's (at a step that rolled out) and the update's: its time
        from the rows handed over to these metrics and its peak memory (GPU only), the slowest rank's."""
        update = torch.tensor([time.perf_counter() - self.update_started, _peak_memory_gb(self.request.device)],
                              dtype=torch.float64)
        if self.request.metrics_group is not None:
            dist.all_reduce(update, op=dist.ReduceOp.MAX, group=self.request.metrics_group)
        metrics, self.metrics = self.metrics, {}
        return {**self.request.feed.step_metrics(), **metrics, "update_time_s": float(update[0]),
                "update_peak_mem_gb": float(update[1])}

    def pending_state(self) -> list[list[Any]]:
        """The prompt feed's (a checkpoint records where the prompts stand; a rollout in progress is not
        kept: a resumed run samples the next prompts afresh)."""
        return self.request.feed.pending_state()
