"""The engine's task library: losses a model family trains with, each with its batch contract.

Families name their task in their ``ModelSpec``; models may import this package (it depends on
nothing but torch and the contract types). Language modelling, multi-token prediction, the VLM
answer loss, node classification, diffusion (rectified flow, DDPM) and autoencoder reconstruction
(VAE) live here.
"""

from veomni.tasks.base import IGNORE_INDEX, BatchContract, LossOutput, Task, task_generator
from veomni.tasks.flow import FLOW_CONTRACT, DiffusionTask
from veomni.tasks.lm import LM_CONTRACT, LanguageModelingTask
from veomni.tasks.mtp import MultiTokenLMTask, next_two_token_labels
from veomni.tasks.node import NODE_CONTRACT, NodeClassificationTask
from veomni.tasks.reconstruction import RECONSTRUCTION_CONTRACT, ReconstructionTask
from veomni.tasks.vlm import VLMTask

__all__ = [
    "IGNORE_INDEX",
    "LM_CONTRACT",
    "BatchContract",
    "DiffusionTask",
    "FLOW_CONTRACT",
    "LanguageModelingTask",
    "LossOutput",
    "MultiTokenLMTask",
    "NODE_CONTRACT",
    "NodeClassificationTask",
    "RECONSTRUCTION_CONTRACT",
    "ReconstructionTask",
    "Task",
    "VLMTask",
    "next_two_token_labels",
    "task_generator",
]
