"""The rollout engine seat (``rl.rollout_engine``) and what a CPU can check of the vLLM adapter.

- Engines register by name; the launcher names an unknown one, and refuses ``vllm`` before any
  worker starts when the package or a CUDA device is missing, naming the fix.
- The weights the adapter pushes carry the names transformers writes for the same model
  (``save_pretrained``'s files: what vLLM's ``load_weights`` reads), dense and mixture of experts.
- Under FSDP 2 and EP 2 (two gloo ranks) the pushed tensors equal the trained full weights bit for
  bit (every shard and expert gathered), in the engine's order of calls: wake the weights, load,
  wake the KV cache; after a rollout, sleep at level 2. The engine object is a recorder of what
  ``LLM.apply_model`` / ``load_weights`` receive (vLLM needs a GPU; ``test_vllm_engine_gpu.py``
  runs the real one where there is one).
"""

from __future__ import annotations

import glob
from pathlib import Path
from types import SimpleNamespace

import pytest
import safetensors.torch
import torch
import transformers

from harness.gloo_ranks import run_distributed
from tests.objectives.test_grpo_run import grpo_run_config
from tests.parallel.test_ep_parity import MOE
from tests.parity_utils import TINY_LLM, full_params, tiny_model
from veomni.config.load import config_to_dict, dump_config
from veomni.config.schema import ParallelConfig, RunConfig
from veomni.contract import build_config, get_model_spec
from veomni.objectives import objective_problems, rollout_engines, vllm_engine
from veomni.objectives.rollout import PolicyEngine
from veomni.objectives.rollout_engines import EngineRequest, build_rollout_engine, register_rollout_engine
from veomni.objectives.vllm_engine import VLLMEngine, completion_of, trained_hf_weights
from veomni.parallel.apply import parallelize
from veomni.parallel.mesh import ParallelDims, build_mesh

MODELS = {"dense": {}, "moe": MOE["softmax"]}


class RecordingLLM:
    """Stands in for ``vllm.LLM``: records sleep / wake calls and the weights its model loads."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.loaded: list[tuple[str, torch.Tensor]] = []
        self.model = SimpleNamespace(load_weights=lambda weights: self.loaded.extend(weights))

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake_up", tuple(tags)))

    def apply_model(self, fn):
        self.calls.append(("load",))
        return [fn(self.model)]


def grpo_config(**rl) -> RunConfig:
    cfg = RunConfig()
    cfg.train.objective = "grpo"
    for key, value in rl.items():
        setattr(cfg.rl, key, value)
    return cfg


def test_engines_register_by_name_and_the_launcher_names_an_unknown_one(monkeypatch) -> None:
    monkeypatch.setattr(rollout_engines, "_ENGINES", dict(rollout_engines._ENGINES))  # the plug-in's, this test's only
    cfg = grpo_config(rollout_engine="vlm")
    assert "unknown engine 'vlm'; did you mean 'vllm'?" in objective_problems(cfg, "chat_prompts")[0]
    built = []
    register_rollout_engine("test-recorder", lambda request: built.append(request) or "engine")
    cfg.rl.rollout_engine = "test-recorder"
    assert objective_problems(cfg, "chat_prompts") == []
    policy = tiny_model()
    request = EngineRequest(cfg, policy, torch.device("cpu"), None, None)
    assert build_rollout_engine(request) == "engine" and built == [request]
    with pytest.raises(ValueError, match="already registered"):
        register_rollout_engine("test-recorder", lambda request: "another")
    cfg.rl.rollout_engine = "builtin"
    engine = build_rollout_engine(request)
    assert isinstance(engine, PolicyEngine) and engine.model is policy


def test_the_launcher_refuses_vllm_without_the_package_or_a_gpu_before_any_worker(tmp_path: Path, capfd,
                                                                                  monkeypatch) -> None:
    from veomni.launch import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(dump_config(config_to_dict(grpo_run_config(tmp_path))))
    monkeypatch.setattr(vllm_engine, "vllm_installed", lambda: False)
    status = main([str(recipe), "--dry-run", "--world-size", "2", "--rl.rollout_engine", "vllm"])
    out = capfd.readouterr()
    text = out.out + out.err
    assert status != 0 and "# plan" not in text
    assert "needs the vllm package, which is not installed: pip install vllm" in text
    assert "needs a CUDA device" in text and "train.device=cpu" in text
    assert "set rl.rollout_engine: builtin" in text
    cfg = grpo_run_config(tmp_path)
    cfg.rl.rollout_engine, cfg.data.kind = "vllm", "vlm_prompts"
    assert any("takes token prompts (chat_prompts data), not the vlm_prompts kind's" in problem
               for problem in vllm_engine.vllm_problems(cfg))


@pytest.mark.parametrize("model", sorted(MODELS))
def test_pushed_weights_carry_the_names_transformers_writes(tmp_path: Path, model: str) -> None:
    model_config = build_config("llm", {**TINY_LLM, **MODELS[model]})
    adapter = get_model_spec("llm").hf_adapter
    pushed = trained_hf_weights(tiny_model(0, **MODELS[model]), adapter, model_config)
    transformers.AutoModelForCausalLM.from_config(adapter.config_to_hf(model_config)).save_pretrained(tmp_path)
    written = set()
    for path in glob.glob(str(tmp_path / "*.safetensors")):
        written |= set(safetensors.torch.load_file(path))
    assert set(pushed) == written


def _push(rank: int, world: int, model: str, parallel: ParallelConfig) -> dict:
    meshes = build_mesh(ParallelDims.resolve(parallel, world), "cpu")
    policy = parallelize(tiny_model(0, **MODELS[model]), parallel, meshes, "cpu")
    with torch.no_grad():  # trained weights: moved off their seeded init, differently per parameter
        for i, param in enumerate(policy.parameters()):
            param.add_(0.01 * (i + 1))
    model_config = build_config("llm", {**TINY_LLM, **MODELS[model]})
    adapter = get_model_spec("llm").hf_adapter
    llm = RecordingLLM()
    engine = VLLMEngine(llm, lambda m: trained_hf_weights(m, adapter, model_config))
    engine.sync_weights(policy)
    engine.release()
    gathered = {**full_params(policy), **{name: buffer for name, buffer in policy.named_buffers()}}
    return {"calls": llm.calls, "loaded": llm.loaded, "want": adapter.state_dict_to_hf(gathered, model_config)}


@pytest.mark.parametrize("model, parallel", [("dense", ParallelConfig(dp_shard=2)),
                                             ("moe", ParallelConfig(dp_shard=2, ep=2))], ids=["fsdp2", "moe-ep2"])
def test_sync_pushes_the_trained_full_weights_bit_for_bit(model: str, parallel: ParallelConfig) -> None:
    for got in run_distributed(_push, 2, model, parallel):
        assert got["calls"] == [("sleep", 2), ("wake_up", ("weights",)), ("load",), ("wake_up", ("kv_cache",)),
                                ("sleep", 2)]
        loaded = dict(got["loaded"])
        assert len(loaded) == len(got["loaded"]) and set(loaded) == set(got["want"])
        for name, tensor in got["want"].items():
            assert loaded[name].shape == tensor.shape and torch.equal(loaded[name], tensor), name


def test_a_vllm_output_becomes_a_completion() -> None:
    def output(tokens, reason):
        steps = [{token: SimpleNamespace(logprob=-0.5 * (i + 1))} for i, token in enumerate(tokens)]
        return SimpleNamespace(token_ids=tokens, logprobs=steps, finish_reason=reason)

    stopped = completion_of(output([5, 9, 2], "stop"))
    assert (stopped.tokens, stopped.logprobs, stopped.finish_reason) == ([5, 9, 2], [-0.5, -1.0, -1.5], "stop")
    assert completion_of(output([7], "length")).finish_reason == "length"
