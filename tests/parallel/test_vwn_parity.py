"""VWN with the next-2-token head under FSDP2 (2 gloo ranks, uneven splits) against one process,
and a short end-to-end trainer run that reports both losses."""

import json

import pytest

from harness.gloo_ranks import run_distributed
from tests.parallel.test_fsdp_parity import global_steps, share
from tests.parity_utils import assert_records_close, run_steps
from tests.trainer_utils import tiny_run_config
from veomni.config.schema import ModelConfig, ParallelConfig

VWN = dict(vwn_m=2, vwn_n=6, mtp=True, mtp_loss_weight=0.3, factorized_embedding=True)
"""r = 3 with GroupNorm, the factorised embedding and MTP: every VWN part is in the graph."""


def _reference(rank, world):
    return run_steps([[samples] for samples in global_steps()], arch="vwn", options=VWN)


def _sharded(rank, world, parallel):
    return run_steps([[share(samples, rank, world)] for samples in global_steps()], parallel,
                     arch="vwn", options=VWN)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference, 1)[0]


@pytest.mark.parametrize("parallel", [ParallelConfig(), ParallelConfig(activation_checkpointing="full")],
                         ids=["fsdp2", "fsdp2-ac-full"])
def test_vwn_mtp_fsdp_matches_single_process(reference, parallel):
    assert {"loss_ntp", "loss_mtp"} <= set(reference["metrics"][0])
    for got in run_distributed(_sharded, 2, parallel):
        assert_records_close(reference, got)


def _train(rank, world, cfg):
    from veomni.train.trainer import Trainer

    return Trainer(cfg).train()


def test_trainer_runs_vwn_with_mtp_and_logs_both_losses(tmp_path):
    cfg = tiny_run_config(tmp_path, max_steps=3)
    cfg.model = ModelConfig(arch="vwn", options={**cfg.model.options, **VWN, "tie_embeddings": True})
    cfg.train.sample_prompt = "def"
    cfg.train.sample_tokens = 4
    history = run_distributed(_train, 2, cfg)[0]
    assert all({"loss_ntp", "loss_mtp"} <= set(step) for step in history)
    last = history[-1]  # loss = ntp + 0.3 * mtp * N_mtp / N_ntp (see mtp_task.py)
    assert last["loss"] == pytest.approx(last["loss_ntp"] + 0.3 * last["loss_mtp"], rel=0.05)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert any({"eval_loss_ntp", "eval_loss_mtp"} <= set(r) for r in records)


def _sequence_parallel(rank, world, parallel):
    return run_steps([[samples] for samples in global_steps()], parallel, arch="vwn", options=VWN)


@pytest.mark.parametrize("world, parallel", [(2, ParallelConfig(sp=2)), (4, ParallelConfig(sp=4))],
                         ids=["sp2", "sp4"])
def test_vwn_mtp_sequence_parallel_matches_single_process(reference, world, parallel):
    """The wide state is per token; the MTP look-ahead (next token, next-2 target) comes from the
    whole row (the task's prepare), so slices whose neighbour holds token i+1 stay exact."""
    for got in run_distributed(_sequence_parallel, world, parallel):
        assert_records_close(reference, got)


VWN_MOE = VWN | dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, router_scoring="sigmoid",
                     shared_expert_intermediate_size=24, router_aux_loss_coef=0.02, router_bias_update_rate=0.05)
"""The same VWN over an MoE backbone: the MTP block's FFN is an MoE layer too."""


def _moe(rank, world, parallel, split):
    """The first step's row has an odd length: sp=2 pads it, and the padding must not be routed
    (``valid_tokens``), or the loads the bias update reads would differ."""
    return run_steps([[share(samples, rank, world) if split else samples] for samples in global_steps()],
                     parallel, arch="vwn", options=VWN_MOE)


@pytest.fixture(scope="module")
def moe_reference():
    return run_distributed(_moe, 1, ParallelConfig(), False)[0]


@pytest.mark.parametrize("world, parallel, split", [
    (2, ParallelConfig(ep=2), True),
    (2, ParallelConfig(sp=2, ep=2), False),
    (4, ParallelConfig(ep=2), True),
], ids=["ep2", "sp2xep2", "ep2xfsdp2"])
def test_vwn_moe_expert_parallel_matches_single_process(moe_reference, world, parallel, split):
    """Experts of every hyper-connected block (and the MTP block) sharded over ep; router biases
    of the auxiliary-loss-free method moved from the global load, identically everywhere."""
    assert all(m["moe/bias_update_abs_mean"] > 0 for m in moe_reference["metrics"])  # biases do move
    assert any(n.startswith("mtp.block.mlp.experts") for n in moe_reference["grads"][0])
    for got in run_distributed(_moe, world, parallel, split):
        assert_records_close(moe_reference, got)
        for ref_m, got_m in zip(moe_reference["metrics"], got["metrics"]):
            assert got_m["moe/tokens_per_expert"] == ref_m["moe/tokens_per_expert"]
