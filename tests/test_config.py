"""Recipe loading: overrides, types, path resolution and the error messages users see."""

from pathlib import Path

import pytest

from veomni.config.loader import ConfigError, dump_config, load_config
from veomni.config.schema import ParallelConfig
from veomni.parallel.mesh import LayoutError, ParallelDims

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


def test_unknown_arch_lists_known(tmp_path):
    with pytest.raises(ConfigError, match="llm"):
        load_config(write(tmp_path, RECIPE.replace("arch: llm", "arch: nope")))


def test_dump_round_trips(tmp_path):
    cfg = load_config(write(tmp_path))
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again) == cfg


def test_layout_resolution():
    assert ParallelDims.resolve(ParallelConfig(), 4).dp_shard == 4
    dims = ParallelDims.resolve(ParallelConfig(dp_replicate=2), 4)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_size) == (2, 2, 4)
    with pytest.raises(LayoutError, match="does not divide the world size 4"):
        ParallelDims.resolve(ParallelConfig(dp_replicate=3), 4)
    with pytest.raises(LayoutError, match="set parallel.dp_shard to 2"):
        ParallelDims.resolve(ParallelConfig(dp_replicate=2, dp_shard=4), 4)
