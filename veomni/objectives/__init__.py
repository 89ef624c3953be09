"""Training objectives: what a run optimises, chosen by ``train.objective`` (``registry.py``).

Importing the package registers the engine's objectives: ``sft`` (the family's own task, the
default) and the preference objectives ``dpo``, ``ipo`` and ``simpo`` (``preference.py``),
and ``grpo``, online RL with verifiable rewards (``grpo_objective.py``). A plug-in
package registers its own with ``register_objective``.
"""

from veomni.objectives import grpo_objective as grpo_objective  # registers grpo
from veomni.objectives import preference as preference  # registers dpo, ipo, simpo
from veomni.objectives.registry import FeedRequest as FeedRequest
from veomni.objectives.registry import FrozenModels as FrozenModels
from veomni.objectives.registry import Objective as Objective
from veomni.objectives.registry import ObjectiveRequest as ObjectiveRequest
from veomni.objectives.registry import build_objective as build_objective
from veomni.objectives.registry import objective_problems as objective_problems
from veomni.objectives.registry import register_objective as register_objective
