"""Recipe loading: overrides, types, path resolution and the error messages users see."""

import dataclasses
from pathlib import Path

import pytest

from veomni.config import load as loader
from veomni.config.load import ConfigError, dump_config, load_config
from veomni.config.schema import CheckpointConfig, ParallelConfig, RunConfig
from veomni.parallel.mesh import LayoutError, ParallelDims

VLM = Path(__file__).resolve().parents[2] / "recipes" / "seed1.5-vl" / "tiny.yaml"

RECIPE = """\
model:
  arch: llm
  hidden_size: 64
  num_layers: 2
data:
  train_path: corpus/train
  tokenizer: tok
train:
  lr: 3e-4
  max_steps: 5
parallel:
  dp_shard: -1
"""


def write(tmp_path: Path, text: str = RECIPE) -> Path:
    path = tmp_path / "recipes" / "r.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_yaml_values_and_types(tmp_path):
    cfg = load_config(write(tmp_path))
    assert cfg.train.lr == pytest.approx(3e-4)  # YAML 1.1 reads 3e-4 as a string
    assert cfg.train.max_steps == 5
    assert cfg.model.options == {"hidden_size": 64, "num_layers": 2}


def test_relative_paths_resolve_against_the_recipe_folder(tmp_path):
    cfg = load_config(write(tmp_path))
    assert cfg.data.train_path == str((tmp_path / "recipes" / "corpus" / "train").resolve())


def test_cli_overrides_win_and_are_typed(tmp_path):
    cfg = load_config(write(tmp_path), ["--train.max_steps", "9", "--log.wandb=true", "--model.hidden_size", "32"])
    assert cfg.train.max_steps == 9 and cfg.log.wandb is True and cfg.model.options["hidden_size"] == 32


def test_unknown_key_names_file_line_and_closest_key(tmp_path):
    path = write(tmp_path, RECIPE.replace("  max_steps: 5", "  max_step: 5"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert f"{path}:10" in message and "train.max_step" in message and "did you mean 'train.max_steps'" in message


def test_unknown_model_key_suggests_model_field(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'model.num_layers'"):
        load_config(write(tmp_path, RECIPE.replace("num_layers", "num_layer")))


def test_unknown_section_and_cli_key(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        load_config(write(tmp_path, RECIPE + "trian:\n  lr: 1\n"))
    with pytest.raises(ConfigError, match="--train.lrr.*did you mean 'train.lr'"):
        load_config(write(tmp_path), ["--train.lrr", "1"])


@pytest.mark.parametrize(
    "override, needle",
    [
        (["--train.max_steps", "ten"], "expected an integer"),
        (["--train.lr", "fast"], "expected a number"),
        (["--log.wandb", "3"], "expected true or false"),
        (["--parallel.activation_checkpointing", "some"], "is not one of"),
    ],
)
def test_wrong_types_are_rejected(tmp_path, override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(write(tmp_path), override)


def test_lora_rank_zero_with_lora_keys_is_refused(tmp_path):
    """``lora.rank: 0`` turns LoRA off: with targets (or train, init_from_peft) it would silently train
    the whole model, so it is refused naming the key; rank 0 alone, or no lora section, trains it."""
    recipe = write(tmp_path / "lora", RECIPE + "lora:\n  rank: 8\n  targets: [q_proj, v_proj]\n")
    with pytest.raises(ConfigError, match=r"r\.yaml:\d+: lora\.targets is set but lora\.rank is 0, which turns LoRA "
                                          r"off and trains the whole model: set lora\.rank > 0"):
        load_config(recipe, ["--lora.rank", "0"])
    with pytest.raises(ConfigError, match=r"lora\.train is set but lora\.rank is 0"):
        load_config(write(tmp_path), ["--lora.train", "[head]"])
    with pytest.raises(ConfigError, match=r"lora\.rank must be >= 0"):
        load_config(recipe, ["--lora.rank", "-1"])
    assert load_config(recipe).lora.rank == 8
    assert load_config(write(tmp_path), ["--lora.rank", "0"]).lora.rank == 0


def test_unknown_arch_lists_known(tmp_path):
    with pytest.raises(ConfigError, match="llm"):
        load_config(write(tmp_path, RECIPE.replace("arch: llm", "arch: nope")))


def test_dump_round_trips(tmp_path):
    cfg = load_config(write(tmp_path))
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again) == cfg


def test_dotted_override_reaches_a_nested_model_leaf():
    image = load_config(VLM, ["--model.encoders.image.num_layers", "3"]).model.options["encoders"]["image"]
    assert image["num_layers"] == 3 and image["hidden_size"] == 96  # the recipe's other keys stay


def test_yaml_block_on_the_command_line_merges_into_the_recipe_mapping():
    llm = load_config(VLM, ["--model.llm", "{hidden_size: 64}"]).model.options["llm"]
    assert llm["hidden_size"] == 64 and llm["num_layers"] == 4 and llm["family"] == "qwen3"


def test_merge_is_deep_and_anything_but_a_mapping_replaces(tmp_path):
    options = load_config(VLM, ["--model.encoders", "{image: {num_layers: 2}}"]).model.options
    image = options["encoders"]["image"]
    assert image["num_layers"] == 2 and image["patch_size"] == 14
    assert options["llm"]["hidden_size"] == 128

    scaling = "  rope_scaling: {rope_type: linear, factor: 2.0}\n"
    path = write(tmp_path, RECIPE.replace("data:\n", scaling + "data:\n"))
    merged = load_config(path, ["--model.rope_scaling.factor", "4.0"]).model.options["rope_scaling"]
    assert merged == {"rope_type": "linear", "factor": 4.0}
    assert load_config(path, ["--model.rope_scaling", "null"]).model.options["rope_scaling"] is None


@pytest.mark.parametrize("override, needle", [
    (["--train.max_step.x", "1"],
     "--train.max_step.x: unknown key 'train.max_step'; did you mean 'train.max_steps'"),
    (["--train.foo.bar", "1"], "--train.foo.bar: unknown key 'train.foo'; valid keys: train.betas"),
    (["--train.lr.x", "1"], "--train.lr.x: 'train.lr.x' is nested too deep: 'train.lr' takes one value"),
    (["--train.lr", "{x: 1}"], "--train.lr: 'train.lr.x' is nested too deep"),
], ids=["near-key", "unknown", "under-a-scalar", "yaml-block"])
def test_closed_sections_stay_flat(tmp_path, override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path), override)
    assert needle in str(err.value)


def test_bad_nested_model_key_names_the_flag(capsys):
    from veomni.launch import main

    assert main([str(VLM), "--dry-run", "--model.encoders.image.num_layer", "3"]) == 2
    assert ("config error: --model.encoders.image.num_layer: unknown option 'num_layer' in "
            "model.encoders.image; did you mean 'num_layers'?") in capsys.readouterr().err


def test_bad_nested_model_key_in_the_file_names_its_line(tmp_path, capsys):
    from veomni.launch import main

    text = VLM.read_text().replace("      num_layers: 4", "      num_layer: 4")
    path = write(tmp_path, text)
    line = text.splitlines().index("      num_layer: 4") + 1
    assert main([str(path), "--dry-run"]) == 2
    assert f"config error: {path}:{line}: unknown option 'num_layer'" in capsys.readouterr().err


@dataclasses.dataclass
class _CheckpointWithInit(CheckpointConfig):
    init: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _RunWithInit(RunConfig):
    checkpoint: _CheckpointWithInit = dataclasses.field(default_factory=_CheckpointWithInit)


def test_dict_field_of_paths_in_a_closed_section(tmp_path, monkeypatch):
    """A dict-typed closed field (a stand-in for a sub-module -> folder map) takes a dotted key whole,
    merges with the recipe, and resolves each value against where that entry was set."""
    monkeypatch.setattr(loader, "RunConfig", _RunWithInit)
    monkeypatch.setattr(loader, "PATH_KEYS", loader.PATH_KEYS | {("checkpoint", "init")})
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, RECIPE + "checkpoint:\n  init:\n    encoders.image: vit\n    llm: lm\n")
    cfg = load_config(path, ["--checkpoint.init.adapters.image", "mine/adapter",
                             "--checkpoint.init.llm", "/abs/lm"])
    assert cfg.checkpoint.init == {"encoders.image": str(path.parent / "vit"), "llm": "/abs/lm",
                                   "adapters.image": str(tmp_path / "mine" / "adapter")}
    with pytest.raises(ConfigError, match="--checkpoint.init.llm: checkpoint.init.llm: expected a string"):
        load_config(path, ["--checkpoint.init.llm", "3"])


def test_layout_resolution():
    assert ParallelDims.resolve(ParallelConfig(), 4).dp_shard == 4
    dims = ParallelDims.resolve(ParallelConfig(dp_replicate=2), 4)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_size) == (2, 2, 4)
    with pytest.raises(LayoutError, match="does not divide the world size 4"):
        ParallelDims.resolve(ParallelConfig(dp_replicate=3), 4)
    with pytest.raises(LayoutError, match="set parallel.dp_shard to 2"):
        ParallelDims.resolve(ParallelConfig(dp_replicate=2, dp_shard=4), 4)
