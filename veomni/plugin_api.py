"""The public API for plug-in authors: every name a model family outside this repository imports.

A family (docs/adding_a_model.md) needs the spec it registers, the plan and hooks its model
declares, the task library and task protocol, the dataset-kind registry and resume protocol, and
the injection points' defaults. They are defined across ``veomni.contract``, ``veomni.tasks``,
``veomni.data`` and ``veomni.ops``; this module lists them in one place, and
``tests/contract/test_plugin_api.py`` holds their signatures to a stored snapshot. Importing from
here is the stable way: the modules behind it may move (when a documented path moves, the old one
keeps working for one release with a deprecation warning, ``veomni/contract/deprecated.py``), a
name here changes only with a CHANGELOG.md entry.

The zoo under ``models/`` imports the defining modules directly: it may only see
``veomni.contract``, ``veomni.ops`` and ``veomni.tasks`` (tests/house), and this module also
reaches the data registry.
"""

from veomni.config.schema import DataConfig
from veomni.contract import (
    ConfiguredModule,
    CostModel,
    HFAdapter,
    ModelSpec,
    MoEHooks,
    ParamRule,
    SampleWriter,
    TrainableModel,
    get_model_spec,
    register_hf_adapter,
    register_model,
)
from veomni.contract.graph_model import GraphCost, GraphModelConfig, MessagePassingLayer
from veomni.contract.hooks import AdaptableExperts, AttentionModule, AttentionSpec, ExpertGroup, MoELayer
from veomni.contract.media import (
    BadMediaMember,
    ChatMarkup,
    MediaFn,
    MediaForm,
    MediaHost,
    MediaItem,
    MediaKind,
    MediaLayout,
    MediaModelConfig,
    ShardableEncoder,
    run_media_locally,
)
from veomni.contract.plan import ParallelPlan, match_modules, module_path_matches, prefixed
from veomni.data.kinds import (
    MERGED_KEY,
    DatasetKind,
    DatasetRequest,
    ResumableDataset,
    find_dataset_states,
    register_dataset,
)
from veomni.data.packing import greedy_pack
from veomni.ops.attention import RowShare, SeqInfo, varlen_attention
from veomni.ops.graph import NeighbourAggregation
from veomni.tasks import (
    IGNORE_INDEX,
    BatchContract,
    DiffusionTask,
    LanguageModelingTask,
    LossOutput,
    MultiTokenLMTask,
    NodeClassificationTask,
    ReconstructionTask,
    Task,
    VLMTask,
    task_generator,
)
from veomni.tasks.base import Baseline, ChanceLevel, RowPlacement
from veomni.tasks.staged import RowLossTask, StagedModel

__all__ = [
    # the spec a family registers, and its parts
    "ModelSpec", "register_model", "get_model_spec", "ParamRule", "CostModel", "SampleWriter",
    "HFAdapter", "register_hf_adapter",
    # the model: its plan and the typed hooks of the modules the plan names
    "TrainableModel", "ConfiguredModule", "ParallelPlan", "prefixed", "match_modules", "module_path_matches",
    "AttentionModule", "AttentionSpec", "SeqInfo", "RowShare", "varlen_attention",
    "MoEHooks", "MoELayer", "ExpertGroup", "AdaptableExperts",
    "MessagePassingLayer", "NeighbourAggregation", "GraphModelConfig", "GraphCost",
    # omni models: media items, their layout in a chat, encoders
    "MediaItem", "MediaKind", "MediaForm", "MediaLayout", "ChatMarkup", "MediaModelConfig", "MediaFn", "MediaHost",
    "ShardableEncoder", "run_media_locally", "BadMediaMember",
    # the task: protocol, batch contract, the engine's library
    "Task", "BatchContract", "RowPlacement", "LossOutput", "Baseline", "ChanceLevel", "IGNORE_INDEX", "task_generator",
    "RowLossTask", "StagedModel",
    "LanguageModelingTask", "MultiTokenLMTask", "VLMTask", "DiffusionTask", "ReconstructionTask",
    "NodeClassificationTask",
    # the dataset kind: registry, request, resume protocol
    "DatasetKind", "DatasetRequest", "register_dataset", "DataConfig", "ResumableDataset", "MERGED_KEY",
    "find_dataset_states", "greedy_pack",
]
