"""Load a run's trained model for inference, for any family, in one call:

    from veomni.inference import load_run
    model = load_run("outputs/toy_regression")       # the newest checkpoint, EMA weights if kept
    prediction = model(rows)

A family without a Hugging Face adapter (every plug-in family unless it registers one) cannot go
through ``scripts/export_hf.sh``; this is its way out of the trainer. The run's ``config.yaml``
says which family it is (its ``model.plugins`` are imported, as in training), the model is built
from the spec as in training, and the checkpoint is read in one process whatever world size or
layout wrote it (DCP resharding). The model comes back on CPU, in ``eval()`` mode. (Not re-exported
as ``veomni.load_run``: ``import veomni`` runs in every model family, which must not import the
checkpoint code's ``torch.distributed``.)

``RunChat`` adds the run's tokenizer: text and conversations in, the model's answers out
(``veomni.generation``; ``scripts/chat.sh RUN_DIR`` talks to it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from torch import nn

from veomni.checkpoint.export import load_run_weights
from veomni.contract import build_model
from veomni.contract.media import MediaHost
from veomni.data.chat.conversation import TemplateChat
from veomni.data.chat.media_dataset import SampleProcessor
from veomni.data.text.packed import load_tokenizer
from veomni.errors import BadConfig
from veomni.generation import SamplingParams, generate


def load_run(run_dir: str | Path, checkpoint: str | Path | None = None, prefer_ema: bool = True) -> nn.Module:
    """The trained model of the run in ``run_dir`` (its ``train.output_dir``), from its newest complete
    checkpoint or ``checkpoint``; with ``prefer_ema`` the EMA weights where the run kept them."""
    run_cfg, _, weights, _ = load_run_weights(Path(run_dir), Path(checkpoint) if checkpoint else None, prefer_ema)
    _, model = build_model(run_cfg.model.arch, run_cfg.model.options)
    model.load_state_dict(weights)
    return model.eval()


class RunChat:
    """A trained run's model with its tokenizer, answering text prompts and conversations through
    ``veomni.generation`` (what ``scripts/chat.sh`` talks to):

        chat = RunChat("outputs/chat_sft")
        chat.reply([{"role": "user", "content": "2 + 3 ="}])         # the assistant's next turn
        chat.complete("def add(a, b):", SamplingParams(max_new_tokens=32, temperature=0.7, seed=0))

    A text model renders conversations with its tokenizer's chat template (as ``chat_text``
    trains on them) and answers until its eos or another special token. A model with encoders
    (omni, Qwen-VL) takes media as the chat shards hold them: ``media={"png": bytes}`` (or
    ``"0.png"``, ``"1.png"``, ``"video.npz"``...) with ``<image>`` / ``<video>`` markers in the
    text, and answers until its chat markup's answer end."""

    def __init__(self, run_dir: str | Path, checkpoint: str | Path | None = None, prefer_ema: bool = True) -> None:
        run_cfg, _, weights, _ = load_run_weights(Path(run_dir), Path(checkpoint) if checkpoint else None, prefer_ema)
        if not run_cfg.data.tokenizer:
            raise BadConfig(f"{run_dir}: the run has no data.tokenizer, so its text cannot be encoded or decoded")
        self.model_config, self.model = build_model(run_cfg.model.arch, run_cfg.model.options)
        self.model.load_state_dict(weights)
        self.model.eval()
        self.tokenizer = load_tokenizer(run_cfg.data.tokenizer)
        self.processor = None
        if isinstance(self.model, MediaHost):
            self.processor = SampleProcessor(self.tokenizer, self.model_config, run_cfg.data.text_key,
                                             run_cfg.data.chat_markup)
            self.stop: tuple[int, ...] = (self.processor.chat.answer_end[-1],)
        else:
            self.stop = tuple(sorted({self.tokenizer.eos_token_id, *self.tokenizer.all_special_ids} - {None}))

    def complete(self, text: str, params: SamplingParams | None = None) -> str:
        """``text`` continued (no chat template), until eos or ``params.max_new_tokens``."""
        params = params or SamplingParams(max_new_tokens=64, stop_token_ids=self.stop)
        ids = self.tokenizer.encode(text)
        return self.tokenizer.decode(generate(self.model, [ids], params)[0].answer, skip_special_tokens=True)

    def reply(self, messages: list[dict[str, str]], params: SamplingParams | None = None,
              media: dict[str, bytes] | None = None) -> str:
        """The assistant's answer to ``messages`` (``{"role", "content"}`` dicts); ``params`` without
        stop tokens stop at the model's answer end."""
        params = params or SamplingParams(max_new_tokens=64)
        if not params.stop_token_ids:
            params = replace(params, stop_token_ids=self.stop)
        if self.processor is None:
            if media:
                raise BadConfig(f"{type(self.model).__name__} has no media encoders: it cannot read {sorted(media)}")
            prompt, layout = TemplateChat(self.tokenizer).prompt(messages, "chat"), None
        else:
            record = {"__key__": "chat", self.processor.json_key: json.dumps({"messages": messages}).encode(),
                      **(media or {})}
            prompt, layout = self.processor(record, add_generation_prompt=True), self.processor.layout
        done = generate(self.model, [prompt], params, layout=layout)[0]
        return self.tokenizer.decode(done.answer, skip_special_tokens=True).strip()
