"""The LoRA recipes (recipes/lora/) plan with --dry-run on the folders data/build_random_pretrained.py
writes: each folder's config.json fits the recipe's model section (the launcher's check_init
compares them field by field), every lora pattern matches, and the whole frozen base is loaded
(no seeded-init warning). The builder skips a folder that is already there."""

from __future__ import annotations

import pytest

from tests.launch.test_launch import REPO
from veomni import launch
from veomni.data.builders import load_script

pytestmark = pytest.mark.full  # recipe checks: the full tier (tests/conftest.py)

RECIPES = {  # recipe -> (builder kind, the checkpoint overrides pointing at the built folder)
    "qwen3_tiny": ("qwen3_tiny", lambda f: ["--checkpoint.init_from_hf", str(f)]),
    "qwen3_moe_ep": ("qwen3_moe_tiny", lambda f: ["--checkpoint.init_from_hf", str(f)]),
    "vlm_tiny": ("vlm_tiny", lambda f: ["--checkpoint.init", f"{{llm: {f}/llm, encoders.image: {f}/vision}}"]),
    "dit_tiny": ("dit_tiny", lambda f: ["--checkpoint.init_from_hf", str(f)]),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    builder, root = load_script(REPO / "data" / "build_random_pretrained.py"), tmp_path_factory.mktemp("pretrained")
    return {kind: builder.build(kind, root / kind) for kind, _ in RECIPES.values()}


@pytest.mark.parametrize("name", list(RECIPES))
def test_lora_recipe_plans_on_its_random_pretrained_folder(name, folders, tmp_path, capsys):
    kind, overrides = RECIPES[name]
    status = launch.main([str(REPO / "recipes" / "lora" / f"{name}.yaml"), "--dry-run", "--world-size", "2",
                          "--train.output_dir", str(tmp_path), *overrides(folders[kind])])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert "# plan" in captured.out and "warning" not in captured.err, captured.err


def test_the_builder_leaves_a_built_folder_alone(folders, capsys):
    folder = folders["qwen3_tiny"]
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    load_script(REPO / "data" / "build_random_pretrained.py").build("qwen3_tiny", folder)
    assert "is there already" in capsys.readouterr().out
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
