"""Write a "pretrained" folder with random weights, for LoRA recipes that must run offline.

A LoRA run adapts a pretrained base it loads through ``checkpoint.init_from_hf`` or
``checkpoint.init``. The recipes in ``recipes/lora/`` cannot download one, so this script makes
a stand-in the way a real one is made: the model class of transformers or diffusers, built from
a small config with its own random init (seeded), written with ``save_pretrained`` (config.json +
safetensors). The recipe then loads it through the same adapters and checks as a real folder,
and its exported PEFT adapters load onto that very folder.

    python data/build_random_pretrained.py qwen3_tiny --out pretrained/random/qwen3_tiny

Kinds (each config equals the model section of its recipe):

    qwen3_tiny      transformers Qwen3ForCausalLM            recipes/lora/qwen3_tiny.yaml
    qwen3_moe_tiny  transformers Qwen3MoeForCausalLM         recipes/lora/qwen3_moe_ep.yaml
    vlm_tiny        <out>/llm: Qwen3ForCausalLM, <out>/vision: the Qwen2-VL vision tower
                                                             recipes/lora/vlm_tiny.yaml
    dit_tiny        diffusers WanTransformer3DModel          recipes/lora/dit_tiny.yaml

A folder already holding the kind's files is left alone (the weights are a function of the kind
and ``--seed``); ``--force`` writes it again.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

QWEN3 = dict(vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, rope_theta=10000.0, max_position_embeddings=2048,
             tie_word_embeddings=True, rms_norm_eps=1e-6)
QWEN3_MOE = dict(QWEN3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.01)
VLM_LLM = dict(QWEN3, vocab_size=8200, max_position_embeddings=512, tie_word_embeddings=False)
VISION = dict(depth=4, embed_dim=96, hidden_size=128, hidden_act="quick_gelu", mlp_ratio=2, num_heads=4,
              in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
WAN = dict(patch_size=[1, 2, 2], num_attention_heads=4, attention_head_dim=32, in_channels=4, out_channels=4,
           text_dim=64, freq_dim=64, ffn_dim=256, num_layers=4, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
           eps=1e-6, rope_max_seq_len=1024)


def _transformers(cls_name: str, config_name: str, options: dict, out: Path) -> None:
    import transformers

    config = getattr(transformers, config_name)(**options)
    getattr(transformers, cls_name)(config).save_pretrained(out)


def _vision(out: Path) -> None:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
        Qwen2VLVisionConfig,
    )

    Qwen2VisionTransformerPretrainedModel(Qwen2VLVisionConfig(**VISION)).save_pretrained(out)


def _wan(out: Path) -> None:
    from diffusers import WanTransformer3DModel

    WanTransformer3DModel(**WAN).save_pretrained(out)


BUILDERS = {
    "qwen3_tiny": lambda out: _transformers("Qwen3ForCausalLM", "Qwen3Config", QWEN3, out),
    "qwen3_moe_tiny": lambda out: _transformers("Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE, out),
    "vlm_tiny": lambda out: (_transformers("Qwen3ForCausalLM", "Qwen3Config", VLM_LLM, out / "llm"),
                             _vision(out / "vision")),
    "dit_tiny": _wan,
}
FOLDERS = {"vlm_tiny": ("llm", "vision")}
"""Kinds that write sub-folders (one per ``checkpoint.init`` entry) instead of one folder."""


def build(kind: str, out: Path, seed: int = 0, force: bool = False) -> Path:
    """Write ``kind``'s folder at ``out`` (skipped when it is there already); returns ``out``."""
    if kind not in BUILDERS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(BUILDERS)}")
    folders = [out / sub for sub in FOLDERS.get(kind, ("",))]
    if not force and all((folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
                         for folder in folders):
        print(f"[build_random_pretrained] {out} is there already ({kind})")
        return out
    torch.manual_seed(seed)
    BUILDERS[kind](out)
    (out / "random_pretrained.json").write_text(json.dumps({"kind": kind, "seed": seed}) + "\n")
    print(f"[build_random_pretrained] wrote {kind} with random weights (seed {seed}) to {out}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=sorted(BUILDERS))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="write the folder again even if it is there")
    args = parser.parse_args(argv)
    build(args.kind, args.out, args.seed, args.force)


if __name__ == "__main__":
    main()
