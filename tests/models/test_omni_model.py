"""The omni model: encoder features land on the placeholder positions, in order; without media it
is exactly the bare LLM; freezing; config errors; sequence parallelism refused."""

from __future__ import annotations

import pytest
import torch

from harness.media_bytes import png_bytes
from tests.omni_utils import TINY_OMNI, TOKENIZER, chat_record, tiny_omni
from tests.parity_utils import assert_parity
from veomni.config.schema import TrainConfig
from veomni.contract import build_config, build_model
from veomni.data.chat.media_dataset import SampleProcessor, pack_chat_samples
from veomni.data.text.packed import load_tokenizer
from veomni.optim import build_optimizer


def _batch(config, records):
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    return process, pack_chat_samples([process(r) for r in records])


def test_features_replace_placeholder_embeddings_in_order():
    config, model = tiny_omni()
    records = [
        chat_record("a", "What color?", "red", png_bytes(1, 56, 84)),
        chat_record("b", "Plain text question", "no"),
        chat_record("c", "What color?", "blue", png_bytes(2, 84, 28)),
    ]
    process, batch = _batch(config, records)
    seen = {}
    model.llm.layers[0].register_forward_pre_hook(lambda _m, args: seen.update(x=args[0].detach()))
    model(
        batch["input_ids"],
        batch["position_ids"],
        batch["cu_seqlens"],
        batch["max_seqlen"],
        media=batch["media"],
    )
    x = seen["x"]
    image = batch["media"]["image"]
    expected_features = torch.cat(
        [model.encoders["image"](**process.media(r)["image"][0].inputs) for r in (records[0], records[2])]
    )
    positions = image["positions"]
    assert positions.numel() == expected_features.shape[0] == (6 + 3)  # 2x3 and 3x1 merged tokens
    assert_parity(x[positions], expected_features.detach(), "x[positions]")
    text = torch.ones(x.shape[0], dtype=torch.bool)
    text[positions] = False
    torch.testing.assert_close(
        x[text], model.llm.embed_tokens(batch["input_ids"][text]).detach(), rtol=0, atol=0
    )
    # placeholders are never targets, and only the answers (and their eos) are
    assert (batch["labels"][positions - 1] == -100).all()
    assert int((batch["labels"] != -100).sum()) == sum(
        len(process.chat._text(a)) + 1 for a in ("red", "no", "blue")
    )


def test_sample_logits_do_not_depend_on_packing_neighbours():
    config, model = tiny_omni()
    a = chat_record("a", "What color?", "red", png_bytes(1, 56, 84))
    b = chat_record("b", "What color?", "blue", png_bytes(2, 84, 56))
    _, alone = _batch(config, [a])
    _, packed = _batch(config, [b, a])

    def run(batch):
        return model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"], batch["max_seqlen"],
                     media=batch["media"])

    start = int(packed["cu_seqlens"][1])
    assert_parity(run(packed)[start:], run(alone), "run(packed)[start:]")


def test_without_media_equals_the_bare_llm():
    _, omni = tiny_omni()
    _, llm = build_model("llm", TINY_OMNI["llm"])
    llm.load_state_dict(omni.llm.state_dict())
    ids = torch.randint(0, 8192, (40,))
    positions = torch.cat([torch.arange(25), torch.arange(15)])
    cu = torch.tensor([0, 25, 40], dtype=torch.int32)
    torch.testing.assert_close(omni(ids, positions, cu, 25), llm(ids, positions, cu, 25), rtol=0, atol=0)


def test_freeze_components_get_no_gradient_and_no_optimizer_state():
    _, model = tiny_omni(freeze=["encoders.image", "llm"])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("encoders.image.merger.") for n in trainable)
    optimizer = build_optimizer(model, TrainConfig(lr=0.1))
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in model.parameters() if p.requires_grad}
    _, adapter_frozen = tiny_omni(freeze=["adapters.image"])
    frozen = {n for n, p in adapter_frozen.named_parameters() if not p.requires_grad}
    assert frozen == {
        n for n, _ in adapter_frozen.named_parameters() if n.startswith("encoders.image.merger.")
    }


@pytest.mark.parametrize(
    "options, message",
    [
        ({"freeze": ["encoder.image"]}, "did you mean 'encoders.image'"),
        (
            {"encoders": {"image": {**TINY_OMNI["encoders"]["image"], "out_hidden_size": 48}}},
            "must equal the LLM's",
        ),
        ({"encoders": {"sound": {}}}, "unknown modality 'sound'"),
        ({"llm": {**TINY_OMNI["llm"], "hidden_sise": 3}}, "did you mean 'hidden_size'"),
    ],
)
def test_bad_config_is_named(options, message):
    with pytest.raises(ValueError, match=message):
        build_config("omni", {**TINY_OMNI, **options})
