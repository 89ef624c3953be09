"""DPO, IPO and SimPO against TRL, which this project did not write: on a tiny random Qwen3 built
from a transformers config and the same pairs, our losses, rewards, log-probabilities and
gradients equal TRL's.

DPO (``loss_type="sigmoid"``) and IPO run through ``DPOTrainer.compute_loss`` (TRL's own
tokenisation, collator, padded forward of policy and reference model and loss); SimPO is TRL's
``CPOTrainer.cpo_loss`` (``loss_type="simpo"``, ``cpo_alpha=0``, its SimPO form) on the length-averaged
log-probabilities of TRL's ``get_batch_logps``. Ours: the chat_preference kind's rows of the same
records, our packed model with the HF weights, ``PreferenceTask`` with a frozen reference.
TRL 1.16's sigmoid loss has no label smoothing (it moved to ``robust``/``exo_pair``): DPO's
conservative smoothing is tested against its formula in ``test_preference_losses.py``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import datasets  # trl's, a dev dependency: imported, never skipped (docs/testing.md)
import pytest
import torch
import transformers
import trl
from trl.experimental.cpo import CPOTrainer

from models.llm import hf_adapter
from tests.chat_utils import write_chat_tokenizer, write_jsonl
from tests.data.test_chat_preference_data import pair
from tests.parity_utils import assert_grads_parity, assert_scalar_parity
from veomni.config.schema import DataConfig, RunConfig
from veomni.contract import build_model
from veomni.data.build_loader import build_dataloader
from veomni.data.text.packed import load_tokenizer
from veomni.objectives import FrozenModels, ObjectiveRequest, build_objective
from veomni.tasks.lm import LanguageModelingTask

PAIRS = 4
BETA = 0.2


def _hf_qwen3(seed: int) -> transformers.PreTrainedModel:
    config = transformers.Qwen3Config(vocab_size=8256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _ours(hf: transformers.PreTrainedModel) -> torch.nn.Module:
    cfg = hf_adapter.config_from_hf(hf.config)
    _, model = build_model("llm", vars(cfg))
    model.load_state_dict(hf_adapter.state_dict_from_hf(hf.state_dict(), cfg), strict=True)
    return model


def _hf_grads(hf: transformers.PreTrainedModel) -> dict[str, torch.Tensor]:
    grads = {name: p.grad for name, p in hf.named_parameters()}
    return hf_adapter.state_dict_from_hf(grads, hf_adapter.config_from_hf(hf.config))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trl")
    tokenizer = write_chat_tokenizer(tmp / "tokenizer")
    records = [{k: pair(i)[k] for k in ("prompt", "chosen", "rejected")} for i in range(PAIRS)]
    path = write_jsonl(tmp / "pairs.jsonl", [json.dumps(r) for r in records])
    cfg = DataConfig(kind="chat_preference", train_path=str(path), eval_path=str(path), tokenizer=str(tokenizer),
                     text_key="json", max_seq_len=128, tokens_per_micro_batch=1024)
    batch = next(iter(build_dataloader(cfg, "eval", load_tokenizer(str(tokenizer)), 0, 1, 0, None,
                                       kind="chat_preference")))
    return SimpleNamespace(tmp=tmp, records=records, batch=batch,
                           tokenizer=transformers.AutoTokenizer.from_pretrained(str(tokenizer)))


def _our_run(objective: str, batch: dict, policy_hf, reference_hf, beta: float = BETA,
             label_smoothing: float = 0.0, rpo_alpha: float = 0.0) -> SimpleNamespace:
    cfg = RunConfig()
    cfg.train.objective, cfg.preference.beta, cfg.preference.label_smoothing = objective, beta, label_smoothing
    cfg.preference.rpo_alpha = rpo_alpha
    found = build_objective(ObjectiveRequest(cfg, LanguageModelingTask()))
    policy = _ours(policy_hf)
    frozen = _ours(reference_hf).requires_grad_(False)
    found.attach(FrozenModels(policy, lambda: frozen, False, None))
    out = found.task(policy, found.task.prepare(dict(batch)))
    (out.loss_sum / out.loss_units).backward()
    metrics = {name: float(value) / count for name, (value, count) in out.metrics.items()}
    grads = {name: p.grad for name, p in policy.named_parameters()}
    return SimpleNamespace(loss=float(out.loss_sum.detach()) / out.loss_units, metrics=metrics, grads=grads)


def _trl_dpo(setup, loss_type: str | list[str], policy_hf, reference_hf, loss_weights: list[float] | None = None,
             pairs_per_batch: int = PAIRS) -> SimpleNamespace:
    """TRL's loss, metrics and gradients of the mean over the pairs, in batches of ``pairs_per_batch``."""
    loss_types = [loss_type] if isinstance(loss_type, str) else loss_type
    args = trl.DPOConfig(output_dir=str(setup.tmp / "out"), beta=BETA, loss_type=loss_types, report_to=[],
                         loss_weights=loss_weights, use_cpu=True, per_device_train_batch_size=pairs_per_batch,
                         bf16=False, max_length=None)
    trainer = trl.DPOTrainer(model=policy_hf, ref_model=reference_hf, args=args,
                             train_dataset=datasets.Dataset.from_list(setup.records), processing_class=setup.tokenizer)
    examples = [trainer.train_dataset[i] for i in range(PAIRS)]
    rows = [e["prompt_ids"] + e[name] for name in ("chosen_ids", "rejected_ids") for e in examples]
    trainer.model.train()
    batches = [examples[i:i + pairs_per_batch] for i in range(0, PAIRS, pairs_per_batch)]
    loss = 0.0
    for batch in batches:
        part = trainer.compute_loss(trainer.model, trainer.data_collator(batch)) / len(batches)
        part.backward()
        loss += float(part.detach())
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return SimpleNamespace(loss=loss, metrics=metrics, grads=_hf_grads(policy_hf), rows=rows)


def _our_rows(batch: dict) -> list[list[int]]:
    bounds = batch["cu_seqlens"].tolist()
    rows = [batch["input_ids"][a:b].tolist() for a, b in zip(bounds, bounds[1:])]
    return rows[0::2] + rows[1::2]  # TRL's order: every chosen, then every rejected


@pytest.mark.parametrize("loss_type,objective", [("sigmoid", "dpo"), ("ipo", "ipo")])
def test_dpo_and_ipo_equal_trl_dpo_trainer(setup, loss_type: str, objective: str) -> None:
    theirs = _trl_dpo(setup, loss_type, _hf_qwen3(0), _hf_qwen3(1))
    assert _our_rows(setup.batch) == theirs.rows, "the same records render to the same tokens as TRL's"
    ours = _our_run(objective, setup.batch, _hf_qwen3(0), _hf_qwen3(1))
    assert abs(theirs.metrics["rewards/margins"]) > 1e-3, "the reference differs from the policy"
    assert_scalar_parity(ours.loss, theirs.loss, f"{objective} loss")
    for ours_name, their_name in [("rewards_chosen", "rewards/chosen"), ("rewards_rejected", "rewards/rejected"),
                                  ("rewards_margin", "rewards/margins"), ("logps_chosen", "logps/chosen"),
                                  ("logps_rejected", "logps/rejected")]:
        assert_scalar_parity(ours.metrics[ours_name], theirs.metrics[their_name], f"{objective} {ours_name}")
    assert ours.metrics["rewards_accuracy"] == theirs.metrics["rewards/accuracies"]
    assert_grads_parity(ours.grads, theirs.grads, f"{objective} gradients")


def test_rpo_alpha_equals_trl_sigmoid_plus_sft_loss(setup) -> None:
    """``preference.rpo_alpha``: TRL's ``loss_type=["sigmoid", "sft"]``, ``loss_weights=[1, alpha]``.
    TRL averages the NLL over every chosen token of its micro-batch, ours over each pair's tokens
    and then over pairs (RPO's per-reply form, independent of how pairs are batched): the two agree
    pair by pair, so TRL runs one pair per batch here (the pairs' chosen replies differ in length)."""
    alpha = 0.7
    theirs = _trl_dpo(setup, ["sigmoid", "sft"], _hf_qwen3(0), _hf_qwen3(1), loss_weights=[1.0, alpha],
                      pairs_per_batch=1)
    ours = _our_run("dpo", setup.batch, _hf_qwen3(0), _hf_qwen3(1), rpo_alpha=alpha)
    plain = _our_run("dpo", setup.batch, _hf_qwen3(0), _hf_qwen3(1))
    assert ours.loss - plain.loss > 1.0, "the NLL term is in the loss"
    assert_scalar_parity(ours.loss, theirs.loss, "dpo + rpo_alpha loss")
    assert_grads_parity(ours.grads, theirs.grads, "dpo + rpo_alpha gradients")
    assert_scalar_parity((ours.loss - plain.loss) / alpha, ours.metrics["nll_chosen"], "nll_chosen metric")


def test_simpo_equals_trl_cpo_simpo_loss(setup) -> None:
    """With label smoothing: CPOTrainer's SimPO smooths as ours does."""
    gamma, smoothing = 0.5, 0.1
    policy = _hf_qwen3(0)
    rows = _our_rows(setup.batch)
    bounds = setup.batch["cu_seqlens"].tolist()
    packed_labels = setup.batch["labels"]
    halves = [packed_labels[a:b] for a, b in zip(bounds, bounds[1:])]
    halves = halves[0::2] + halves[1::2]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, half) in enumerate(zip(rows, halves)):  # TRL's layout: labels unshifted, masked as -100
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, 1:len(row)] = half[:-1]
    attention = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
    logits = policy(input_ids=ids, attention_mask=attention).logits
    average = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    this = SimpleNamespace(beta=BETA, loss_type="simpo", simpo_gamma=gamma, label_smoothing=smoothing, alpha=0.0,
                           accelerator=SimpleNamespace(device=torch.device("cpu")))
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(
        this, average[:PAIRS], average[PAIRS:])
    losses.mean().backward()
    cfg_gamma = RunConfig().preference.simpo_gamma
    assert cfg_gamma == gamma
    ours = _our_run("simpo", setup.batch, _hf_qwen3(0), _hf_qwen3(1), label_smoothing=smoothing)
    assert_scalar_parity(ours.loss, float(losses.mean()), "simpo loss")
    assert_scalar_parity(ours.metrics["rewards_chosen"], float(chosen_rewards.mean()), "simpo rewards_chosen")
    assert_scalar_parity(ours.metrics["rewards_rejected"], float(rejected_rewards.mean()), "simpo rewards_rejected")
    assert_grads_parity(ours.grads, _hf_grads(policy), "simpo gradients")


def test_a_changed_beta_or_reference_breaks_parity(setup) -> None:
    theirs = _trl_dpo(setup, "sigmoid", _hf_qwen3(0), _hf_qwen3(1))
    for planted in (_our_run("dpo", setup.batch, _hf_qwen3(0), _hf_qwen3(1), beta=BETA * 1.01),
                    _our_run("dpo", setup.batch, _hf_qwen3(0), _hf_qwen3(2))):
        with pytest.raises(AssertionError):
            assert_scalar_parity(planted.loss, theirs.loss, "planted")
        with pytest.raises(AssertionError):
            assert_grads_parity(planted.grads, theirs.grads, "planted")
