"""Generation of Qwen2.5-VL with an image and with a video in the prompt, against transformers;
and of the Seed1.5-VL-style omni model, cached against uncached, and with ``n`` continuations per
prompt, whose images are encoded once.

A tiny ``Qwen2_5_VLForConditionalGeneration`` with random weights (the one of
``tests/models/test_qwen_vl_hf_parity.py``) goes through the project's HF import; prompts are
``ChatSample`` chats whose media items carry the same patches and grids transformers is fed. Our
batched greedy decode (both prompts in one row) equals transformers' ``generate`` on each prompt
alone: the encoder's features land on the placeholders and the M-RoPE positions continue from the
prompt's largest one (for the video, whose time positions outrun its height and width, that
differs from recomputing the finished text's positions). Decoding with and without the cache
agrees, and the log-probabilities equal one forward over the finished sequences at
``sequence_positions``.
"""

from __future__ import annotations

import torch

from harness.media_bytes import png_bytes
from models.omni.mrope_positions import token_types
from tests.models.test_qwen_vl_hf_parity import END, IMAGE, SECONDS, START, VIDEO, _hf_model
from tests.omni_utils import TINY_OMNI, TOKENIZER, chat_record, random_png, tiny_omni
from tests.parity_utils import assert_parity
from veomni.checkpoint.hf_io import load_hf_pretrained
from veomni.contract import get_model_spec
from veomni.contract.media import MediaItem
from veomni.data.chat.media_dataset import ChatSample, SampleProcessor
from veomni.data.chat.template import EncodedChat
from veomni.data.text.packed import load_tokenizer
from veomni.generation import SamplingParams, generate
from veomni.generation.prompts import pack_prompts

NEW_TOKENS = 8
PROMPT_MEDIA = {"image": (1, 4, 10), "video": (4, 6, 8)}  # grid_thw in patches; the video has 4 temporal patches


def _prompt(kind: str, patch_dim: int, seed: int) -> tuple[ChatSample, dict]:
    """A chat of text, one image or video, text; and transformers' inputs for it alone."""
    gen = torch.Generator().manual_seed(seed)
    t, h, w = PROMPT_MEDIA[kind]
    pad = IMAGE if kind == "image" else VIDEO
    before, after = torch.randint(0, 180, (4,), generator=gen), torch.randint(0, 180, (3,), generator=gen)
    ids = torch.cat([before, torch.tensor([START]), torch.full((t * h * w // 4,), pad), torch.tensor([END]), after])
    patches = torch.randn(t * h * w, patch_dim, generator=gen)
    grid = torch.tensor([[t, h, w]])
    places = torch.nonzero(ids == pad).flatten().tolist()
    meta = {"second_per_grid_ts": SECONDS} if kind == "video" else {}
    item = MediaItem({"patches": patches, "grid_thw": grid}, len(places), len(places), meta)
    chat = EncodedChat(ids.tolist(), [False] * len(ids), {kind: places})
    hf = {"input_ids": ids[None], "mm_token_type_ids": token_types(ids, IMAGE, VIDEO)[None]}
    if kind == "image":
        hf.update(pixel_values=patches, image_grid_thw=grid)
    else:
        hf.update(pixel_values_videos=patches, video_grid_thw=grid, second_per_grid_ts=torch.tensor([SECONDS]))
    return ChatSample(kind, chat, {kind: [item]}, len(ids)), hf


def test_greedy_tokens_with_an_image_and_a_video_equal_transformers(tmp_path) -> None:
    hf = _hf_model("qwen2_5_vl", tied=False)
    hf.save_pretrained(tmp_path)
    arch, cfg, state = load_hf_pretrained(tmp_path)
    model = get_model_spec(arch).instantiate(cfg).eval()
    model.load_state_dict(state, strict=True)
    layout = cfg.media_layout()
    prompts, hf_inputs = zip(*(_prompt(kind, cfg.encoder_configs["image"].patch_dim, seed)
                               for seed, kind in enumerate(("image", "video"))))

    got = generate(model, prompts, SamplingParams(max_new_tokens=NEW_TOKENS), layout=layout)
    with torch.no_grad():
        want = [hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, inputs[
            "input_ids"].shape[1]:].tolist() for inputs in hf_inputs]
    assert want[0] != want[1] and all(len(set(w)) > 2 for w in want), "degenerate decode"
    assert [c.tokens for c in got] == want

    plain = generate(model, prompts, SamplingParams(max_new_tokens=NEW_TOKENS), layout=layout, use_cache=False)
    assert [c.tokens for c in plain] == want
    batch = pack_prompts(prompts, [c.tokens for c in got], layout)
    with torch.no_grad():
        logp = torch.log_softmax(model(batch["input_ids"], batch["position_ids"], batch["cu_seqlens"],
                                       batch["max_seqlen"], media=batch["media"]), -1)
    for i, (prompt, done) in enumerate(zip(prompts, got)):
        start = int(batch["cu_seqlens"][i]) + len(prompt.chat.ids) - 1
        want_logp = logp[torch.arange(start, start + len(done.tokens)), torch.tensor(done.tokens)]
        assert_parity(torch.tensor(done.logprobs), want_logp, f"{prompt.key}: log-probs vs a forward pass")
        assert_parity(torch.tensor(plain[i].logprobs), want_logp, f"{prompt.key}: uncached log-probs")


def test_seed_style_omni_model_generates_the_same_with_and_without_the_cache() -> None:
    """The Seed1.5-VL-style omni model (native-resolution ViT, 1-D RoPE LLM): chats with images of two
    sizes and one without, sampled, decode the same tokens and log-probabilities either way."""
    config, model = tiny_omni(seed=1, llm={**TINY_OMNI["llm"], "tie_embeddings": False})
    with torch.no_grad():
        for param in model.llm.parameters():
            param.mul_(8.0 if param.ndim > 1 else 1.0)  # init_std 0.02 decodes one token over and over
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    records = [chat_record("a", "What color?", "", png_bytes(1)), chat_record("b", "Plain question", ""),
               chat_record("c", "Which shape?", "", random_png(40, 70, 2))]
    prompts = [process(record, add_generation_prompt=True) for record in records]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50, seed=0)
    cached = generate(model.eval(), prompts, params, layout=process.layout)
    plain = generate(model, prompts, params, layout=process.layout, use_cache=False)
    assert [c.tokens for c in cached] == [c.tokens for c in plain]
    assert len({tuple(c.tokens) for c in cached}) == 3
    for a, b in zip(cached, plain):
        assert_parity(torch.tensor(a.logprobs), torch.tensor(b.logprobs), f"{a.tokens}: log-probs")


def test_n_continuations_of_a_chat_encode_its_image_once() -> None:
    """Three continuations per chat (an RL group): each chat's image goes through the encoder once and
    its prompt through the decoder once; the continuations equal the uncached decode of three copies
    of the chat (which encodes each copy)."""
    config, model = tiny_omni(seed=1, llm={**TINY_OMNI["llm"], "tie_embeddings": False})
    with torch.no_grad():
        for param in model.llm.parameters():
            param.mul_(8.0 if param.ndim > 1 else 1.0)
    process = SampleProcessor(load_tokenizer(str(TOKENIZER)), config)
    records = [chat_record("a", "What color?", "", png_bytes(1)), chat_record("b", "Plain question", ""),
               chat_record("c", "Which shape?", "", random_png(40, 70, 2))]
    prompts = [process(record, add_generation_prompt=True) for record in records]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50, seed=0, n=3)
    encoded: list[int] = []  # patch rows of real media (a forward without media encodes a dummy)
    encode = model.media_fn

    def counting(name, encoder, item, dummy):
        if item is not None:
            encoded.append(item["inputs"]["patches"].shape[0])
        return encode(name, encoder, item, dummy)
    model.media_fn = counting
    fed: list[int] = []
    hook = model.llm.embed_tokens.register_forward_hook(lambda module, args, out: fed.append(args[0].numel()))
    cached = generate(model.eval(), prompts, params, layout=process.layout)
    images = pack_prompts(prompts, [[] for _ in prompts], process.layout)["media"]["image"]["inputs"]["patches"]
    assert encoded == [images.shape[0]], "the prefill encodes every image of the chats, once"
    assert sum(fed) == sum(len(p.chat.ids) for p in prompts) + sum(len(c.tokens) - 1 for c in cached)
    model.media_fn = encode
    hook.remove()
    plain = generate(model, prompts, params, layout=process.layout, use_cache=False)
    assert [c.tokens for c in cached] == [c.tokens for c in plain]
    for a, b in zip(cached, plain):
        assert_parity(torch.tensor(a.logprobs), torch.tensor(b.logprobs), f"{a.tokens}: log-probs")
    assert all(len({tuple(c.tokens) for c in cached[i:i + 3]}) > 1 for i in range(0, 9, 3))
