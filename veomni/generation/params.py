"""What a caller asks of generation (``SamplingParams``) and what it gets back (``Completion``).

The contract is the one RL rollouts need (and vLLM / TRL users know): prompts in; per prompt ``n``
continuations, each with its generated tokens, the log-probability of each under the model, and why
it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from veomni.errors import BadConfig

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    ``temperature == 0`` is greedy (the argmax; ``top_p`` and ``top_k`` do not apply); above 0 the
    token is drawn from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely
    tokens (0: all) and then to the smallest set whose probability reaches ``top_p`` (1.0: all),
    the order of vLLM and transformers. Generation of a prompt ends after one of
    ``stop_token_ids`` (which is kept, as the last token) or after ``max_new_tokens`` tokens.
    ``seed``: the same seed, model, prompts and device draw the same tokens; None draws from torch's
    global random state. ``n``: continuations per prompt (vLLM's ``n``; an RL group), drawn
    independently after one prefill of the prompt that they share.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (1 = no nucleus cut), got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = no cut), got {self.top_k}")
        if self.n < 1:
            problems.append(f"n (continuations per prompt) must be at least 1, got {self.n}")
        if problems:
            raise BadConfig("SamplingParams: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class Completion:
    """One prompt's continuation.

    ``tokens``: the generated ids, a stop token included as the last one (``finish_reason ==
    "stop"``); ``logprobs[i]``: ``log_softmax(logits)[tokens[i]]`` of the model's logits at
    temperature 1 (no temperature, top-k or top-p applied): the log-probability of the token under
    the model itself, which is what a policy-gradient ratio compares with the trained model's
    forward pass on ``prompt + tokens``. ``finish_reason``: ``"stop"`` (a stop token) or
    ``"length"`` (``max_new_tokens`` reached).
    """

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason = "length"

    @property
    def answer(self) -> list[int]:
        """``tokens`` without the stop token that ended them (what an answer's text decodes from)."""
        return self.tokens[:-1] if self.finish_reason == "stop" else list(self.tokens)
