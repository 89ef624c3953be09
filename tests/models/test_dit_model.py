"""The DiT on packed rows: a packed sample computes what it computes alone, nothing outside
``attn_fn`` mixes tokens (what sequence parallelism relies on), cross-attention keeps to each
sample's caption, gradients reach every weight, and the cost model counts what runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from models.dit import diffusion_task
from models.dit.batch import pack_latents, unpack_tokens
from models.dit.config import DiTConfig
from models.dit.cost import DiTCost, forward_flops
from models.dit.model import DiTModel
from tests.parity_utils import assert_parity
from veomni.contract import get_model_spec
from veomni.ops.attention import cross_varlen_attention

CFG = DiTConfig(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4,
                out_channels=4, text_dim=16, freq_dim=32, ffn_dim=48, num_layers=2)
# (C, F, H, W) latents: an image, a 3-frame clip, a 2-frame clip with another H/W; their caption lengths
SHAPES = [(4, 1, 4, 6), (4, 3, 6, 4), (4, 2, 8, 8)]
TEXT_LENGTHS = [3, 5, 1]
PADDING = 3


def _random_model(cfg: DiTConfig = CFG, seed: int = 0) -> DiTModel:
    torch.manual_seed(seed)
    model = DiTModel(cfg)
    with torch.no_grad():  # init_weights zeroes proj_out: randomise every weight so nothing is trivial
        for param in model.parameters():
            param.normal_(0.0, 0.1)
    return model


def _samples(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    latents = [torch.randn(shape, generator=generator) for shape in SHAPES]
    texts = [torch.randn(n, CFG.text_dim, generator=generator) for n in TEXT_LENGTHS]
    return latents, texts, torch.tensor([10.0, 500.0, 990.0])


def _with_padding(batch: dict, tokens: int) -> dict:
    """``batch`` with ``tokens`` padding tokens after its samples (sample_index -1), as packing adds."""
    out = dict(batch)
    out["latents"] = torch.cat([batch["latents"], torch.randn(tokens, batch["latents"].shape[1])])
    out["positions"] = torch.cat([batch["positions"], torch.zeros(tokens, 3, dtype=torch.int64)])
    out["sample_index"] = torch.cat([batch["sample_index"], torch.full((tokens,), -1)])
    return out


def test_packed_row_equals_each_sample_alone_and_padding_is_zero():
    model = _random_model()
    latents, texts, timesteps = _samples()
    batch = _with_padding(pack_latents(latents, texts, timesteps, CFG.patch_size), PADDING)
    with torch.no_grad():
        packed = model(batch["latents"], batch)
        assert torch.equal(packed[-PADDING:], torch.zeros(PADDING, packed.shape[1]))
        for latent, text, t, out in zip(latents, texts, timesteps, unpack_tokens(packed, batch, CFG.patch_size)):
            alone = model.forward_video(latent[None], t[None], text[None])[0]
            assert_parity(out, alone, "out")


def test_a_slice_of_the_row_computes_its_tokens_as_the_whole_row_does():
    """Sequence parallelism hands each rank a slice of the row-wise fields and the whole-row ones
    unchanged; with a token-local attention (only ``attn_fn`` may mix tokens), a slice must give
    exactly the whole row's outputs for its tokens."""
    model = _random_model()
    for block in model.blocks:
        block.attn1.attn_fn = lambda q, k, v, seq: v * q.sigmoid()
    latents, texts, timesteps = _samples()
    batch = _with_padding(pack_latents(latents, texts, timesteps, CFG.patch_size), PADDING)
    with torch.no_grad():
        whole = model(batch["latents"], batch)
        for piece in torch.arange(len(whole)).tensor_split(3):  # cuts inside samples
            local = dict(batch)
            for field in ("latents", "positions", "sample_index"):
                local[field] = batch[field][piece]
            assert_parity(model(local["latents"], local), whole[piece], "model(local['latents'], local)")


def test_gradients_reach_every_weight_through_the_diffusion_loss():
    model = _random_model()
    latents, texts, timesteps = _samples()
    batch = _with_padding(pack_latents(latents, texts, timesteps, CFG.patch_size), PADDING)
    task = diffusion_task(CFG)
    prepared = task.prepare(batch, torch.Generator().manual_seed(3))
    out = task(model, prepared)
    assert out.loss_units == len(batch["latents"]) - PADDING  # real tokens: the loss is their per-element mean
    out.loss_sum.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_init_weights_predicts_zero_and_draws_from_the_global_rng():
    with torch.device("meta"):
        model = DiTModel(CFG)
    model.to_empty(device="cpu")
    torch.manual_seed(4)
    model.init_weights()
    first = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(4)
    model.init_weights()
    assert all(torch.equal(first[k], v) for k, v in model.state_dict().items())
    latents, texts, timesteps = _samples()
    batch = pack_latents(latents, texts, timesteps, CFG.patch_size)
    assert not model(batch["latents"], batch).any()


def _reference_cross_attention(q, k, v, q_sample_index, kv_cu_seqlens):
    rows = []
    for token, sample in enumerate(q_sample_index.tolist()):
        start, end = kv_cu_seqlens[sample].item(), kv_cu_seqlens[sample + 1].item()
        if sample < 0 or start == end:
            rows.append(torch.zeros(q.shape[1], v.shape[2]))
            continue
        scores = F.scaled_dot_product_attention(q[token][:, None], k[start:end].transpose(0, 1),
                                                v[start:end].transpose(0, 1))
        rows.append(scores[:, 0])
    return torch.stack(rows)


@pytest.mark.parametrize("context", [5, 0])
def test_cross_attention_to_one_caption_needs_no_mask(context):
    generator = torch.Generator().manual_seed(6)
    q_sample_index = torch.tensor([0, 0, 0, 0, -1])
    q = torch.randn(5, 2, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(context, 2, 8, generator=generator) for _ in range(2))
    kv_cu_seqlens = torch.tensor([0, context], dtype=torch.int32)
    out = cross_varlen_attention(q, k, v, q_sample_index, kv_cu_seqlens)
    assert_parity(out, _reference_cross_attention(q, k, v, q_sample_index, kv_cu_seqlens), "one caption")
    out.sum().backward()
    assert not q.grad[-1].any()


@pytest.mark.parametrize("per_sample", [False, True, None])
def test_cross_varlen_attention_keeps_to_each_samples_context(per_sample):
    generator = torch.Generator().manual_seed(5)
    # a sequence-parallel slice: starts inside sample 1, padding, an empty-context sample (2), sample 0
    q_sample_index = torch.tensor([1, 1, 1, 0, 0, 3, 3, 2, 2, -1, -1, 3])
    kv_cu_seqlens = torch.tensor([0, 4, 7, 7, 12], dtype=torch.int32)
    q = torch.randn(12, 2, 8, generator=generator, requires_grad=True)
    k = torch.randn(12, 2, 8, generator=generator, requires_grad=True)
    v = torch.randn(12, 2, 8, generator=generator)
    out = cross_varlen_attention(q, k, v, q_sample_index, kv_cu_seqlens, per_sample=per_sample)
    assert_parity(out, _reference_cross_attention(q, k, v, q_sample_index, kv_cu_seqlens), "out")
    out.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()
    assert not q.grad[q_sample_index == -1].any() and not q.grad[q_sample_index == 2].any()


def test_cost_model_counts_the_matmuls_of_a_forward():
    """``forward_flops`` against torch's FLOP counter on a real forward of each sample alone (one
    sample per row, so no attention kernel computes masked-out scores; SDPA's math backend, whose
    matmuls the counter sees); a packed row costs their sum."""
    model = _random_model()
    cost = get_model_spec("dit").cost
    latents, texts, timesteps = _samples()
    counted = []
    for latent, text, t in zip(latents, texts, timesteps):
        counter = FlopCounterMode(display=False)
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
            model.forward_video(latent[None], t[None], text[None])
        counted.append(counter.get_total_flops())
        tokens = latent[0].numel() // 4
        assert forward_flops(CFG, [tokens], [len(text)]) == counted[-1]
    batch = pack_latents(latents, texts, timesteps, CFG.patch_size)
    assert cost.batch_flops(model, batch) == 3 * sum(counted)
    lone = DiTModel(DiTConfig(**{**CFG.__dict__, "text_len": TEXT_LENGTHS[0]}))
    assert cost.sample_flops(lone, batch["cu_seqlens"][1].item()) == 3 * counted[0]


def test_cost_model_memory_and_report():
    model = DiTModel(CFG)
    cost = DiTCost()
    none, selective, full = (cost.activation_bytes_per_unit(model, 2, mode) for mode in ("none", "selective", "full"))
    assert none > selective > full > 0
    assert cost.activated_params(model) == sum(p.numel() for p in model.parameters())
    assert "75,600 patch tokens" in cost.report_lines(model, 75_600)[0]
    with pytest.raises(ValueError, match="checkpointing"):
        cost.activation_bytes_per_unit(model, 2, "sometimes")


@pytest.mark.parametrize(("change", "message"), [
    ({"qk_norm": "rms_norm"}, "qk_norm"),
    ({"attention_head_dim": 4}, "attention_head_dim"),
    ({"patch_size": (1, 2)}, "patch_size"),
    ({"objective": "edm"}, "objective"),
    ({"text_dropout": 1.0}, "text_dropout"),
])
def test_config_validation_names_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        DiTConfig(**change).validate()
