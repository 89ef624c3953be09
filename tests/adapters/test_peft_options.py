"""Every field of PEFT's ``LoraConfig`` honoured both ways or refused by name, against ``peft``
itself on a random transformers Qwen3 built from config: folders ``peft`` made with per-layer
ranks and alphas (``rank_pattern`` / ``alpha_pattern``) and a module trained whole
(``modules_to_save``) load into ours with peft's logits; ours, exported with the same, load in
``peft`` with our logits; options our LoRA does not compute are refused naming the field, by
``load_peft`` and by the launcher (``--dry-run``) before any worker starts."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.adapters.test_peft_parity import _hf_model, _logits, _ours  # noqa: E402
from tests.parity_utils import assert_parity, tiny_model  # noqa: E402
from veomni import launch  # noqa: E402
from veomni.adapters.lora import add_lora  # noqa: E402
from veomni.adapters.peft_fields import HONOURED, IRRELEVANT, REFUSED  # noqa: E402
from veomni.adapters.peft_io import export_peft, load_peft  # noqa: E402
from veomni.config.schema import LoraConfig  # noqa: E402
from veomni.contract import get_model_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
PATTERNS = dict(rank_pattern={"v_proj": 2}, alpha_pattern={"q_proj": 3})
# our names: a pattern without dots names a layer's last segment, as PEFT's does
OURS = LoraConfig(rank=4, alpha=8.0, targets=TARGETS, train=["lm_head"], rank_pattern={"v_proj": 2},
                  alpha_pattern={"q_proj": 3.0})


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(seed))


def _peft_made(folder: Path, **options) -> torch.nn.Module:
    """A folder ``peft`` makes on the seeded base, its adapters and saved modules random; the model."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, **options)
    torch.manual_seed(3)
    made = peft.get_peft_model(_hf_model(False), config).eval()
    with torch.no_grad():
        for name, param in made.named_parameters():
            if "modules_to_save" in name:
                param.normal_(0.0, 0.5)
    made.save_pretrained(str(folder))
    return made


def test_a_folder_with_layer_patterns_and_a_saved_module_loads_with_peft_logits(tmp_path):
    made = _peft_made(tmp_path / "made", modules_to_save=["lm_head"], **PATTERNS)
    with torch.no_grad():
        theirs = made(_ids(2)[None]).logits[0]
    ours, adapter, cfg = _ours(_hf_model(False), OURS)
    assert load_peft(ours, tmp_path / "made", adapter, cfg, OURS) == 2 * len(TARGETS)
    assert_parity(_logits(ours, _ids(2)), theirs, "patterns and modules_to_save")


SELECTIONS = {  # peft's options -> the same layers (and scaling) in our recipe's terms
    "regex": (dict(target_modules=r".*\.(q|v)_proj"), dict(targets=["q_proj", "v_proj"])),
    "layers_to_transform": (dict(target_modules=TARGETS, layers_to_transform=[1]), dict(targets=["layers.1.attn.*"])),
    "exclude_modules": (dict(target_modules=TARGETS, exclude_modules=["k_proj"]),
                        dict(targets=["q_proj", "v_proj", "o_proj"])),
    "rslora_dropout": (dict(target_modules=TARGETS, use_rslora=True, lora_dropout=0.1), dict(targets=TARGETS,
                                                                                            rslora=True)),
}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_how_peft_selects_layers_is_honoured_by_the_adapters_it_holds(name, tmp_path):
    theirs_options, ours_options = SELECTIONS[name]
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **theirs_options)
    torch.manual_seed(3)
    made = peft.get_peft_model(_hf_model(False), config).eval()
    made.save_pretrained(str(tmp_path / "made"))
    with torch.no_grad():
        theirs = made(_ids(2)[None]).logits[0]
    lora = LoraConfig(rank=4, alpha=8.0, **ours_options)
    ours, adapter, cfg = _ours(_hf_model(False), lora)
    load_peft(ours, tmp_path / "made", adapter, cfg, lora)
    assert_parity(_logits(ours, _ids(2)), theirs, name)
    wider = dataclasses.replace(lora, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])
    ours, adapter, cfg = _ours(_hf_model(False), wider)
    with pytest.raises(ValueError, match=r"no adapter for layers\.\d\.(attn|mlp)\.\w+\.weight"):
        load_peft(ours, tmp_path / "made", adapter, cfg, wider)


@pytest.mark.parametrize("recipe, field", [
    (dataclasses.replace(OURS, rank_pattern={}), "lora.rank_pattern: {'layers.0.attn.v_proj': 2"),
    (dataclasses.replace(OURS, alpha_pattern={}), "lora.alpha_pattern: {'layers.0.attn.q_proj': 3.0"),
    (dataclasses.replace(OURS, train=[]), "trains lm_head.weight whole (modules_to_save ['lm_head'])"),
])
def test_a_folder_whose_patterns_or_saved_modules_the_recipe_lacks_is_refused_by_name(recipe, field, tmp_path):
    _peft_made(tmp_path / "made", modules_to_save=["lm_head"], **PATTERNS)
    ours, adapter, cfg = _ours(_hf_model(False), recipe)
    with pytest.raises(ValueError, match=re.escape(field)):
        load_peft(ours, tmp_path / "made", adapter, cfg, recipe)


def test_our_export_with_patterns_and_a_module_trained_whole_loads_in_peft_with_our_logits(tmp_path):
    hf = _hf_model(False)
    ours, adapter, cfg = _ours(hf, OURS)
    with torch.no_grad():  # trained-looking adapters and head
        for name, param in ours.named_parameters():
            if name.endswith("lora_B") or name == "lm_head.weight":
                param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    want = _logits(ours, _ids(1))
    folder = export_peft(ours, adapter, cfg, OURS, tmp_path / "out")
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["lm_head"]
    assert config["rank_pattern"] == {f"model.layers.{i}.self_attn.v_proj": 2 for i in range(2)}
    reference = peft.PeftModel.from_pretrained(hf, str(folder)).eval()
    with torch.no_grad():
        assert_parity(reference(_ids(1)[None]).logits[0], want, "exported to peft")
    again, _, _ = _ours(_hf_model(False), OURS)  # and back into ours
    load_peft(again, folder, adapter, cfg, OURS)
    assert_parity(_logits(again, _ids(1)), want, "exported and read back")


REFUSALS = [(dict(use_dora=True), "use_dora=True: DoRA"), (dict(bias="lora_only"), "bias='lora_only'"),
            (dict(lora_bias=True), "lora_bias=True"), (dict(layer_replication=[[0, 2], [1, 2]]), "layer_replication"),
            (dict(trainable_token_indices=[3, 5]), "trainable_token_indices")]


@pytest.mark.parametrize("options, field", REFUSALS, ids=[f for _, f in REFUSALS])
def test_an_option_our_lora_does_not_compute_is_refused_by_name(options, field, tmp_path):
    _peft_made(tmp_path / "made", **options)
    lora = LoraConfig(rank=4, alpha=8.0, targets=TARGETS)
    ours, adapter, cfg = _ours(_hf_model(False), lora)
    with pytest.raises(ValueError, match=re.escape(field) + ".*merge_and_unload"):
        load_peft(ours, tmp_path / "made", adapter, cfg, lora)


@pytest.mark.parametrize("options, field, dry", [(dict(use_dora=True), "use_dora=True", True),
                                                 (dict(use_dora=True), "use_dora=True", False),
                                                 (dict(init_lora_weights="olora"), "init_lora_weights='olora'", True),
                                                 (dict(modules_to_save=["lm_head"]), "modules_to_save", True),
                                                 (PATTERNS, "rank_pattern {'v_proj': 2}", True)])
def test_the_launcher_refuses_them_before_any_worker(options, field, dry, tmp_path, capsys):
    config = {"r": 4, "lora_alpha": 8, "peft_type": "LORA", "target_modules": TARGETS, **options}
    (tmp_path / "made").mkdir()
    (tmp_path / "made" / "adapter_config.json").write_text(json.dumps(config))
    (tmp_path / "made" / "adapter_model.safetensors").write_bytes(b"")
    plan = ["--dry-run", "--world-size", "1"] if dry else []
    status = launch.main([str(REPO / "recipes" / "quickstart" / "tiny_llm.yaml"), *plan,
                          "--lora.rank", "4", "--lora.alpha", "8", "--lora.init_from_peft", str(tmp_path / "made"),
                          "--train.output_dir", str(tmp_path / "run")])
    output = capsys.readouterr().err
    assert status == 2 and f"config error: lora.init_from_peft: {tmp_path / 'made'}" in output, output
    assert field in output, output


def test_every_field_of_peft_lora_config_is_judged_and_in_the_docs():
    table = (REPO / "docs" / "lora.md").read_text()
    judged = HONOURED | IRRELEVANT | REFUSED
    fields = [f.name for f in dataclasses.fields(peft.LoraConfig)]
    assert [f for f in fields if f not in judged] == []
    assert [f for f in fields if f"| `{f}` |" not in table] == []


def test_a_tied_head_trained_whole_trains_and_goes_out_merged_only(tmp_path):
    model = tiny_model(tie_embeddings=True)
    lora = LoraConfig(rank=4, alpha=8.0, train=["lm_head"])
    add_lora(model, lora)
    assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight.requires_grad
    with pytest.raises(ValueError, match="tied weight lm_head.weight whole: PEFT's modules_to_save would hold"):
        export_peft(model, get_model_spec("llm").hf_adapter, model.config, lora, tmp_path / "out")


def test_a_peft_export_names_the_pretrained_folder_that_is_its_whole_base(tmp_path):
    from veomni.checkpoint.export import export_base
    from veomni.config.schema import RunConfig

    cfg = RunConfig(lora=LoraConfig(rank=4))
    cfg.checkpoint.init_from_hf = str(tmp_path / "hf")
    assert export_base(cfg, tmp_path / "peft") == str((tmp_path / "hf").resolve())
    assert not (tmp_path / "peft").exists()  # nothing written: the folder is the base
