"""LoRA under every parallel layout equals one process (issue 30): FSDP2 and HSDP, expert
parallelism with one adapter per expert, Ulysses and ring attention, activation checkpointing
and per-block compile, and pp=2 under every pipeline schedule (tied embeddings, pp x FSDP,
expert adapters in stages, and stages that hold nothing to train).

``add_lora`` adapts the plain model before the parallel recipe, so each layout must shard,
split and pipeline the adapters like any other parameter and leave the frozen base alone. The
adapters start non-trivial (seeded ``lora_A`` and ``lora_B``, the same on every rank): with
PEFT's zero ``lora_B`` every ``lora_A`` gradient would be zero and prove nothing. Per step the
loss and every adapter gradient, after the SGD steps every parameter, must match the
one-process run by the parity rule (fp32); the base gets no gradient on any rank and ends as
it started.
"""

import functools

import pytest
import torch

from harness.gloo_ranks import run_distributed
from tests.parallel.test_ep_parity import MOE
from tests.parallel.test_pipeline_parity import OPTIONS, global_steps, merged, run_pipeline_steps, split
from tests.parity_utils import assert_records_close, run_steps, tiny_model
from veomni.adapters.lora import add_lora, is_adapter_name
from veomni.config.schema import LoraConfig, ParallelConfig


def adapt(model: torch.nn.Module, targets: tuple[str, ...] = ()) -> torch.nn.Module:
    """``add_lora`` (rank 4; empty ``targets``: every linear and expert group in the blocks),
    then every adapter drawn from its own seeded generator (no draw from the global RNG, so the
    base weights stay those of the unadapted build); a meta build keeps its meta adapters."""
    add_lora(model, LoraConfig(rank=4, alpha=8.0, targets=list(targets)))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter_name(name):
                values = 0.1 * torch.randn(param.shape, generator=gen)
                if not param.is_meta:
                    param.copy_(values)
    return model


@functools.cache
def start(options: tuple, targets: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """The adapted model's parameters before training, by name."""
    model = adapt(tiny_model(**dict(options)), targets)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def check_lora(reference: dict, got: dict, options: dict, experts: bool = False, targets: tuple[str, ...] = ()
               ) -> None:
    """``got`` equals ``reference`` (both LoRA runs), gradients reach every adapter and nothing
    else, and the frozen base ends as it started."""
    before = start(tuple(sorted(options.items())), targets)
    adapters = sorted(n for n in before if is_adapter_name(n))
    assert any(n.endswith("experts.gate_up_proj_lora_A") for n in adapters) == experts
    for grads in reference["grads"]:
        assert sorted(grads) == adapters, "only the adapters get gradients"
        assert all(grads[n].abs().max() > 0 for n in adapters), "the adapters are not trivial"
    for step, grads in enumerate(got["grads"]):
        assert sorted(grads) == adapters, f"step {step}: gradients of {sorted(set(grads) - set(adapters))}"
    assert sorted(got["params"]) == sorted(before)
    assert_records_close(reference, got)
    for name, value in before.items():
        if is_adapter_name(name):
            assert not torch.equal(got["params"][name], value), f"adapter {name} did not train"
        else:
            assert torch.equal(got["params"][name], value), f"frozen {name} changed"


DENSE: dict = {}
MOE_OPTIONS = MOE["softmax"]


def _run(rank, world, parallel, options):
    """Rank r reads samples r, r + dp, ... of its data-parallel position (ranks of one sp x cp
    group read the same samples and keep their slices)."""
    split = parallel.sp * parallel.cp
    dp_world, dp_rank = world // split, rank // split
    return run_steps([[samples[dp_rank::dp_world]] for samples in global_steps()], parallel, options=options,
                     prepare=adapt)


@functools.cache
def reference(options: tuple) -> dict:
    return run_distributed(_run, 1, ParallelConfig(), dict(options))[0]


@pytest.mark.parametrize("world, parallel, options", [
    (2, ParallelConfig(), DENSE),
    pytest.param(4, ParallelConfig(dp_replicate=2), DENSE, marks=pytest.mark.full),
    (2, ParallelConfig(activation_checkpointing="full"), DENSE),
    (2, ParallelConfig(activation_checkpointing="selective", reshard_after_forward=False), DENSE),
    (2, ParallelConfig(ep=2), MOE_OPTIONS),
    pytest.param(4, ParallelConfig(ep=2), MOE_OPTIONS, marks=pytest.mark.full),
    (2, ParallelConfig(sp=2), DENSE),
    (2, ParallelConfig(cp=2, cp_mesh=[1, 2]), DENSE),
    pytest.param(2, ParallelConfig(sp=2, ep=2), MOE_OPTIONS, marks=pytest.mark.full),
], ids=["fsdp2", "hsdp2x2", "fsdp2-ac-full", "fsdp2-ac-selective", "ep2", "ep2xfsdp2", "sp2", "ring2", "sp2xep2"])
def test_lora_matches_single_process(world, parallel, options):
    key = tuple(sorted(options.items()))
    for got in run_distributed(_run, world, parallel, options):
        check_lora(reference(key), got, options, experts=bool(options))


@pytest.mark.full
def test_lora_with_per_block_compile(tmp_path):
    """One block (a cold CPU compile is most of the cost); a private inductor cache, so the test
    measures a cold compile and leaves nothing behind."""
    parallel, options = ParallelConfig(compile=True), {"num_layers": 1}
    for got in run_distributed(_run, 2, parallel, options, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}):
        check_lora(reference(tuple(options.items())), got, options)


# ----- pipelines ----------------------------------------------------------------------------
TIED = dict(OPTIONS, tie_embeddings=True)
PP_MOE = dict(OPTIONS, **MOE_OPTIONS)


def _pp_reference(rank, world, options, pieces, targets):
    return run_steps([split(samples, pieces) for samples in global_steps()], options=options,
                     prepare=functools.partial(adapt, targets=targets))


@functools.cache
def pp_reference(options: tuple, pieces: int, targets: tuple[str, ...]) -> dict:
    """``pieces`` micro-batches per step: an MoE's auxiliary losses are per micro-batch."""
    return run_distributed(_pp_reference, 1, dict(options), pieces, targets)[0]


def check_pipeline(options: dict, records: list[dict], experts: bool = False, targets: tuple[str, ...] = ()) -> None:
    reference = pp_reference(tuple(sorted(options.items())), 2 if experts else 1, targets)
    got = merged(records)
    norms = [sum(float(g.double().pow(2).sum()) for g in grads.values()) ** 0.5 for grads in reference["grads"]]
    assert records[0]["grad_norm"] == pytest.approx(norms, rel=1e-5), "the clipped norm is the adapters' alone"
    if options.get("tie_embeddings"):  # one process names the tied weight once, the stages twice
        assert torch.equal(got["params"].pop("lm_head.weight"), got["params"]["embed_tokens.weight"])
    check_lora(reference, got, options, experts, targets)


@pytest.mark.parametrize("schedule, microbatches", [
    pytest.param("GPipe", 2, marks=pytest.mark.full),
    ("1F1B", 4),
    pytest.param("Interleaved1F1B", 4, marks=pytest.mark.full),
    pytest.param("InterleavedZeroBubble", 2, marks=pytest.mark.full),
    ("ZBVZeroBubble", 2),
    pytest.param("DualPipeV", 4, marks=pytest.mark.full),
])
def test_lora_pp2_matches_single_process(schedule, microbatches):
    """The zero-bubble schedules split backward into input and weight steps: the weight step
    must compute the adapters' gradients and skip the frozen weights."""
    parallel = ParallelConfig(pp=2, pp_schedule=schedule)
    check_pipeline(OPTIONS, run_distributed(run_pipeline_steps, 2, parallel, microbatches, OPTIONS, 0.5, "llm",
                                            adapt))


@pytest.mark.parametrize("world, parallel, options", [
    (2, ParallelConfig(pp=2, pp_schedule="1F1B"), TIED),
    pytest.param(2, ParallelConfig(pp=2, pp_schedule="ZBVZeroBubble", activation_checkpointing="full"), OPTIONS,
                 marks=pytest.mark.full),
    pytest.param(4, ParallelConfig(pp=2, pp_schedule="1F1B"), OPTIONS, marks=pytest.mark.full),
    pytest.param(2, ParallelConfig(pp=2, pp_schedule="1F1B"), PP_MOE, marks=pytest.mark.full),
], ids=["tied-1f1b", "zbv-ac-full", "1f1b-x-fsdp2", "moe-1f1b"])
def test_lora_pipeline_compositions(world, parallel, options):
    """A frozen embedding tied to the frozen head across the stages (its copies get no gradient
    to sum), checkpointing under the split backward, pp x FSDP, and expert adapters in stages."""
    check_pipeline(options, run_distributed(run_pipeline_steps, world, parallel, 2, options, 0.5, "llm", adapt),
                   experts=options is PP_MOE)


LAST = ("layers.3.attn.q_proj",)
"""One adapter, in the last block: the first stage (1F1B) or a whole V rank (ZBV's stages 1
and 2) holds nothing that trains, yet runs backward, steps its empty optimizer and passes the
input gradient on."""


@pytest.mark.parametrize("schedule, microbatches", [
    ("1F1B", 2), ("ZBVZeroBubble", 2),
    pytest.param("InterleavedZeroBubble", 2, marks=pytest.mark.full),
    pytest.param("DualPipeV", 4, marks=pytest.mark.full),
])
def test_lora_pp2_with_stages_that_train_nothing(schedule, microbatches):
    parallel = ParallelConfig(pp=2, pp_schedule=schedule)
    adapt_last = functools.partial(adapt, targets=LAST)
    check_pipeline(OPTIONS, run_distributed(run_pipeline_steps, 2, parallel, microbatches, OPTIONS, 0.5, "llm",
                                            adapt_last), targets=LAST)
