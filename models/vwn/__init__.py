"""Virtual Width Networks over the dense decoder. Registered as "vwn": trains with language
modelling, plus next-2-token prediction when ``mtp`` is on."""

from models.llm.cost import LMCost
from veomni.contract import ModelSpec, ParamRule, register_model
from veomni.tasks import LanguageModelingTask, MultiTokenLMTask

from .config import VWNConfig
from .hyper_connection import GeneralizedHyperConnection
from .model import VWNLM


class VWNCost(LMCost):
    def report_lines(self, model: VWNLM, units: int) -> list[str]:
        return model.report_lines(units)


def _task(config: VWNConfig) -> LanguageModelingTask:
    return MultiTokenLMTask(config.mtp_loss_weight) if config.mtp else LanguageModelingTask()


def _param_rules(config: VWNConfig) -> list[ParamRule]:
    """The static maps B and A get no weight decay (the paper); dynamic parts and scales do."""
    return [ParamRule({"weight_decay": 0.0}, pattern=f"**.{name}", name="vwn_static_no_decay")
            for name in GeneralizedHyperConnection.STATIC]


register_model(ModelSpec(name="vwn", config_cls=VWNConfig, build=VWNLM, task=_task, dataset="packed_text",
                         cost=VWNCost(), param_rules=_param_rules))

__all__ = ["VWNLM", "VWNConfig"]
