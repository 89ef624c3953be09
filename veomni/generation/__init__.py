"""Generation with a key/value cache, for the zoo's decoders and vision-language models.

    from veomni.generation import SamplingParams, generate
    completions = generate(model, [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=16, temperature=0.8,
                                                                      top_p=0.95, seed=0))
    completions[0].tokens, completions[0].logprobs, completions[0].finish_reason

Prompts are token-id lists, or ``ChatSample`` chats with images and videos (pass the model's
``MediaLayout``). The cache enters the model through its attention injection point
(``kv_cache.py``), so any family whose decoder attention is an ``AttentionModule`` generates,
unchanged. The end-of-run sample and the evals come here; so can an RL rollout.
"""

from .engine import generate
from .params import Completion, FinishReason, SamplingParams
from .prompts import Prompt, sequence_positions

__all__ = ["Completion", "FinishReason", "Prompt", "SamplingParams", "generate", "sequence_positions"]
