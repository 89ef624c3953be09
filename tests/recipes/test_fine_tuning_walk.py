"""The fine-tuning path a user walks (docs/fine_tuning.md, first section), through the README's
commands: a transformers Qwen3 folder of one's own (random weights, the shipped tokenizer with a
chat template saved into it), a chat jsonl, a LoRA recipe naming only that folder, the data and the
adapters (no model field), ``scripts/train.sh``, ``scripts/export_hf.sh ... --peft``, and ``peft``
on transformers' model giving our run's logits and greedy tokens."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest
import torch
import transformers

from tests.chat_utils import CONVERSATIONS, VOCAB, openai_line, write_chat_tokenizer
from tests.launch.test_launch import REPO, train_sh
from tests.parity_utils import assert_parity

pytestmark = pytest.mark.full  # one whole run through train.sh (tests/conftest.py)

QWEN3 = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
             rope_parameters={"rope_type": "default", "rope_theta": 1e4})


def test_lora_from_a_folder_of_ones_own_to_peft_and_generate(tmp_path):
    import peft

    from veomni.inference import load_run

    folder = tmp_path / "my-qwen3"
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).save_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(write_chat_tokenizer(tmp_path / "chat-tokenizer"))
    tokenizer.save_pretrained(folder)
    (tmp_path / "chat.jsonl").write_text("".join(openai_line(m) + "\n" for m in CONVERSATIONS * 8))
    recipe = tmp_path / "lora.yaml"
    recipe.write_text(textwrap.dedent("""\
        checkpoint:
          init_from_hf: my-qwen3
        data:
          kind: chat_text
          train_path: chat.jsonl
          max_seq_len: 128
          tokens_per_micro_batch: 256
        lora:
          rank: 4
          alpha: 8
        """))
    out = tmp_path / "out"
    result = train_sh(str(recipe), "--train.output_dir", str(out), "--train.max_steps", "3", "--train.lr", "0.05",
                      "--log.progress_bar", "false", env={"NPROC_PER_NODE": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"model section from {folder}/config.json (arch llm); the recipe sets nothing" in result.stderr

    checkpoint = out / "checkpoints" / "step_00000003"
    exported = export_sh(checkpoint, tmp_path / "merged", tmp_path / "peft")
    assert exported.returncode == 0, exported.stderr[-3000:]

    ours = load_run(out)
    base = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor(tokenizer.apply_chat_template(CONVERSATIONS[0][:2], add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)["input_ids"])
    n = len(ids)
    with torch.no_grad():
        want = ours(ids, torch.arange(n), torch.tensor([0, n], dtype=torch.int32), n)
        plain = base(ids[None]).logits[0]
        assert (plain - want).abs().max() > 1e-3, "three steps must move the adapters"
        theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()  # adapts base in place
        assert_parity(theirs(ids[None]).logits[0], want, "peft on transformers vs our run")
        generated = theirs.generate(ids[None], max_new_tokens=4, do_sample=False)[0, n:]
        row = ids.clone()
        for _ in range(4):  # our model's greedy continuation, one token at a time
            logits = ours(row, torch.arange(len(row)), torch.tensor([0, len(row)], dtype=torch.int32), len(row))
            row = torch.cat([row, logits[-1].argmax()[None]])
    assert generated.tolist() == row[n:].tolist()


def export_sh(checkpoint, merged, peft_folder):
    """``bash scripts/export_hf.sh CHECKPOINT OUT --peft OUT-peft``, as the README gives it."""
    return subprocess.run(["bash", str(REPO / "scripts" / "export_hf.sh"), str(checkpoint), str(merged), "--peft",
                           str(peft_folder)], cwd=REPO, env=dict(os.environ), capture_output=True, text=True,
                          timeout=300)
