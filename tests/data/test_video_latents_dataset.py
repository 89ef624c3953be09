"""The ``video_latents`` dataset kind on tiny latent shards written here in the shared format:
every sample once per pass, disjoint data-parallel ranks, exact resume, corrupt samples skipped
and counted, and the launch check of the manifest against the model."""

import io
import json
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_safetensors
from torch import nn

from veomni.config.schema import DataConfig
from veomni.contract import ModelSpec, register_model
from veomni.contract.plan import ParallelPlan
from veomni.data.build_loader import build_dataloader
from veomni.data.kinds import MERGED_KEY, find_dataset_states
from veomni.data.sources import BadDataError
from veomni.data.video.latents import STATE_FORMAT, VideoLatentsDataset, check_video_latents
from veomni.ops.video_patch import unpatchify
from veomni.tasks.flow import DiffusionTask

TEXT_DIM = 8
SHAPES = [(4, 1, 4, 4), (4, 1, 8, 4), (4, 3, 4, 8), (4, 3, 8, 8), (4, 5, 4, 4)]  # 4 to 48 patches of (1, 2, 2)


@dataclass
class StubVideoConfig:
    """What the kind reads of a video model's config (``VideoModelConfig``)."""

    patch_size: tuple[int, int, int] = (1, 2, 2)
    in_channels: int = 4
    out_channels: int = 4
    text_dim: int = TEXT_DIM
    image_dim: int | None = None

    def validate(self) -> None:
        pass


class StubVideoModel(nn.Module):
    def __init__(self, config: StubVideoConfig) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(4, 4)

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan()

    def init_weights(self) -> None:
        nn.init.zeros_(self.proj.weight)


class StubCost:
    def batch_flops(self, model, batch):
        return 0.0

    def sample_flops(self, model, units):
        return 0.0

    def activation_bytes_per_unit(self, model, bytes_per_elem, checkpointing):
        return 0.0

    def activated_params(self, model):
        return 0

    def report_lines(self, model, units):
        return []


register_model(ModelSpec(name="stub_video_latents_reader", config_cls=StubVideoConfig, build=StubVideoModel,
                         task=lambda config: DiffusionTask(), dataset="video_latents", cost=StubCost()))


def _sample_bytes(latent: torch.Tensor, text: torch.Tensor) -> bytes:
    return save_safetensors({"latent": latent.contiguous(), "text": text.contiguous()})


def write_split(folder: Path, samples: int, shards: int, seed: int = 0,
                corrupt: dict[int, str] | None = None) -> dict[str, dict]:
    """A latent split: ``samples`` in ``shards`` tars plus its manifest; returns key -> sample
    (latent, text, caption). ``corrupt``: index -> "bytes" (not safetensors) or "shape" (the
    json disagrees); those are left out of the returned samples."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    written, shapes, examples = {}, {}, {}
    tars = [tarfile.open(folder / f"shard-{i:05d}.tar", "w") for i in range(shards)]
    for index in range(samples):
        key = f"clip{index:04d}"
        shape = SHAPES[index % len(SHAPES)]
        latent = torch.randn(shape, generator=g)
        text = torch.randn(1 + index % 4, TEXT_DIM, generator=g)
        meta = {"caption": f"caption of {key}", "frames": shape[1], "latent_shape": list(shape)}
        payload = _sample_bytes(latent, text)
        damage = (corrupt or {}).get(index)
        if damage == "bytes":
            payload = b"not a safetensors file" + payload[:20]
        elif damage == "shape":
            meta["latent_shape"] = [4, 1, 2, 2]
        else:
            written[key] = {"latent": latent, "text": text, "caption": meta["caption"]}
            name = "x".join(map(str, shape))
            shapes[name] = shapes.get(name, 0) + 1
            examples.setdefault(name, key)
        for member, data in ((f"{key}.latent.safetensors", payload), (f"{key}.json", json.dumps(meta).encode())):
            info = tarfile.TarInfo(member)
            info.size = len(data)
            tars[index % shards].addfile(info, io.BytesIO(data))
    for tar in tars:
        tar.close()
    manifest = {"format_version": 1, "latent_channels": 4, "text_dim": TEXT_DIM, "shapes": shapes,
                "example_keys": examples, "skipped_corrupt": 0}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return written


def _config(path: Path, **overrides) -> DataConfig:
    return DataConfig(**{"kind": "video_latents", "train_path": str(path), "eval_path": str(path),
                         "tokens_per_micro_batch": 96, **overrides})


def _loader(path: Path, split: str, dp_rank: int = 0, dp_size: int = 1, seed: int = 7, **overrides):
    return build_dataloader(_config(path, **overrides), split, None, dp_rank, dp_size, seed,
                            model_config=StubVideoConfig(), kind="video_latents")


def _unpacked(batch: dict) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(caption, latent, text) of every sample in a row, through unpatchify."""
    bounds, text_bounds = batch["cu_seqlens"].tolist(), batch["text_cu_seqlens"].tolist()
    return [(caption, unpatchify(batch["latents"][bounds[i]:bounds[i + 1]], tuple(batch["grid"][i].tolist()),
                                 (1, 2, 2)), batch["text_states"][text_bounds[i]:text_bounds[i + 1]])
            for i, caption in enumerate(batch["captions"])]


def test_an_eval_pass_yields_every_sample_once_as_written(tmp_path):
    samples = write_split(tmp_path / "split", samples=37, shards=3)
    batches = list(_loader(tmp_path / "split", "eval"))
    seen = [item for batch in batches for item in _unpacked(batch)]
    assert sorted(caption for caption, _, _ in seen) == sorted(s["caption"] for s in samples.values())
    for caption, latent, text in seen:
        original = samples[caption.removeprefix("caption of ")]
        torch.testing.assert_close(latent, original["latent"], rtol=0, atol=0)
        torch.testing.assert_close(text, original["text"], rtol=0, atol=0)
    for batch in batches:
        assert int(batch["cu_seqlens"][-1]) == batch["latents"].shape[0] <= 96
        assert (batch["sample_index"] >= 0).all()
    assert [len(list(_loader(tmp_path / "split", "eval"))) for _ in range(2)] == [len(batches)] * 2


@pytest.mark.parametrize("shards", [4, 1], ids=["shard-split", "record-split"])
def test_data_parallel_ranks_read_disjoint_samples_that_cover_the_split(tmp_path, shards):
    samples = write_split(tmp_path / "split", samples=30, shards=shards)
    ranks = [{c for batch in _loader(tmp_path / "split", "eval", rank, 2) for c in batch["captions"]}
             for rank in range(2)]
    assert ranks[0] and ranks[1] and not ranks[0] & ranks[1]
    assert ranks[0] | ranks[1] == {s["caption"] for s in samples.values()}


def _captions(batches) -> list[list[str]]:
    return [batch["captions"] for batch in batches]


def test_training_shuffles_each_epoch_from_the_seed(tmp_path):
    write_split(tmp_path / "split", samples=30, shards=3)
    rows_per_epoch = len(list(_loader(tmp_path / "split", "eval")))

    def epochs(seed):
        it = iter(_loader(tmp_path / "split", "train", seed=seed))
        batches = [next(it) for _ in range(3 * rows_per_epoch)]
        return _captions(batches)

    first = epochs(seed=1)
    assert first == epochs(seed=1)
    assert first != epochs(seed=2)
    epoch_0, epoch_1 = first[:rows_per_epoch], first[rows_per_epoch:2 * rows_per_epoch]
    assert epoch_0 != epoch_1 and sorted(sum(epoch_0, [])) == sorted(sum(epoch_1, []))


@pytest.mark.parametrize("k, workers", [(1, 0), (3, 0), (7, 0), (12, 0), (5, 2)])
def test_resume_after_k_batches_yields_the_same_next_batches(tmp_path, k, workers):
    write_split(tmp_path / "split", samples=40, shards=3, corrupt={5: "bytes"})

    def loader():
        return _loader(tmp_path / "split", "train", max_bad_fraction=0.5, num_workers=workers)

    it = iter(loader())
    reference = [next(it) for _ in range(k + 8)]
    interrupted = loader()
    it = iter(interrupted)
    for _ in range(k):
        next(it)
    state = interrupted.state_dict()
    resumed = loader()
    resumed.load_state_dict(state)
    it = iter(resumed)
    for expected in reference[k:]:
        batch = next(it)
        assert batch["captions"] == expected["captions"]
        torch.testing.assert_close(batch["latents"], expected["latents"], rtol=0, atol=0)


def test_a_position_holds_the_packer_s_buffer(tmp_path):
    """Mid-epoch, records read but not yet packed are part of the state (what makes resume exact)."""
    write_split(tmp_path / "split", samples=40, shards=1)
    dataset = _loader(tmp_path / "split", "train").dataset
    next(iter(dataset))
    state = dataset.state_dict()
    assert state["epoch"] == 0 and state["pending"] and max(state["pending"]) < state["next_record"]


def test_merged_states_restart_at_the_earliest_epoch_of_any_old_rank(tmp_path):
    write_split(tmp_path / "split", samples=20, shards=2)
    states = []
    for rank, steps in ((0, 2), (1, 9)):
        loader = _loader(tmp_path / "split", "train", rank, 2)
        it = iter(loader)
        for _ in range(steps):
            next(it)
        states.append(loader.state_dict())
    merged = VideoLatentsDataset.merge_states(states)
    epochs = [s["epoch"] for state in states for s in find_dataset_states(state, STATE_FORMAT)]
    assert merged[MERGED_KEY]["epoch"] == min(epochs) and max(epochs) > min(epochs)
    with pytest.raises(ValueError, match="pass the states of every rank"):
        VideoLatentsDataset.merge_states(states[:1])
    single = _loader(tmp_path / "split", "train")
    single.load_state_dict(merged)
    assert next(iter(single))["captions"]


def test_corrupt_samples_are_skipped_and_counted(tmp_path, caplog):
    samples = write_split(tmp_path / "split", samples=30, shards=2, corrupt={3: "bytes", 8: "shape"})
    loader = _loader(tmp_path / "split", "eval", max_bad_fraction=0.1)
    seen = {c for batch in loader for c in batch["captions"]}
    assert seen == {s["caption"] for s in samples.values()} and len(seen) == 28
    assert loader.dataset.state_dict()["bad_prior_epochs"] == 2
    assert "clip0003 skipped" in caplog.text and "clip0008 skipped" in caplog.text
    assert "disagrees with the json's latent_shape [4, 1, 2, 2]" in caplog.text
    with pytest.raises(BadDataError, match=r"2 of 30 records were bad"):
        list(_loader(tmp_path / "split", "eval", max_bad_fraction=0.05))
    for rank in range(3):  # 2 shards, 3 consumers: a record-level split, each rank counts every bad record
        loader = _loader(tmp_path / "split", "eval", rank, 3, max_bad_fraction=0.1)
        list(loader)
        assert loader.dataset.state_dict()["bad_prior_epochs"] == 2


def test_a_truncated_shard_counts_the_records_its_manifest_lists(tmp_path):
    """A shard cut in half loses half its records, not one: with the manifest's per-shard counts the
    loss is counted, so ``max_bad_fraction`` trips on a large shard (24 records, 12 cut off)."""
    write_split(tmp_path / "split", samples=48, shards=2)
    manifest = json.loads((tmp_path / "split" / "manifest.json").read_text())
    manifest["shard_records"] = {"shard-00000.tar": 24, "shard-00001.tar": 24}
    (tmp_path / "split" / "manifest.json").write_text(json.dumps(manifest))
    shard = tmp_path / "split" / "shard-00001.tar"
    with tarfile.open(shard) as tar:
        cut = tar.getmembers()[24].offset  # the header of record 12's first member: a record boundary
    shard.write_bytes(shard.read_bytes()[:cut])
    loader = _loader(tmp_path / "split", "eval", max_bad_fraction=0.5)
    list(loader)
    assert loader.dataset.state_dict()["bad_prior_epochs"] == 12
    with pytest.raises(BadDataError, match=r"12 of 48 records were bad"):
        list(_loader(tmp_path / "split", "eval", max_bad_fraction=0.2))


@pytest.mark.parametrize("change, message", [
    ({"shapes": {"4x1x5x4": 3}, "example_keys": {"4x1x5x4": "odd_0001"}},
     r"sample 'odd_0001' of .*: latent shape \[4, 1, 5, 4\] \(C, F, H, W\): patch size \[1, 2, 2\] \(t, h, w\) "
     r"does not divide"),
    ({"latent_channels": 16}, r"have 16 channels, model\.in_channels=4; set model\.in_channels: 16"),
    ({"text_dim": 64}, rf"are 64 wide, model\.text_dim={TEXT_DIM}; set model\.text_dim: 64"),
    ({"shapes": {"4x9x16x16": 1}, "example_keys": {"4x9x16x16": "long_0"}},
     r"the largest latent .* shape \[4, 9, 16, 16\] \(e\.g\. sample 'long_0'\), is 576 patches of \[1, 2, 2\], "
     r"more than data\.tokens_per_micro_batch=96; raise it to at least 576"),
], ids=["patch", "channels", "text-dim", "budget"])
def test_the_launch_check_reads_the_manifest_against_the_model(tmp_path, change, message):
    write_split(tmp_path / "split", samples=5, shards=1)
    assert check_video_latents(_config(tmp_path / "split"), StubVideoConfig()) == []
    manifest_file = tmp_path / "split" / "manifest.json"
    manifest_file.write_text(json.dumps({**json.loads(manifest_file.read_text()), **change}))
    problems = check_video_latents(_config(tmp_path / "split", eval_path=None), StubVideoConfig())
    assert len(problems) == 1 and re.search(message, problems[0]), problems


def test_a_model_with_conditioning_channels_is_refused_until_the_latents_hold_them(tmp_path):
    """An image-to-video model (in_channels = the latent's + conditioning) on text-to-video latents:
    refused saying what is missing, not told to set in_channels to the latent's."""
    write_split(tmp_path / "split", samples=5, shards=1)
    problems = check_video_latents(_config(tmp_path / "split", eval_path=None), StubVideoConfig(in_channels=12))
    assert len(problems) == 1 and "model.in_channels=12 is out_channels=4 plus 8 conditioning channels" in problems[0]
    assert problems[0].startswith("data.train_path: ")


def test_the_launch_check_names_a_model_without_patches_and_a_missing_manifest(tmp_path):
    @dataclass
    class TextOnly:
        vocab_size: int = 10

    lacking = check_video_latents(_config(tmp_path), TextOnly())[0]
    assert "TextOnly lacks patch_size, in_channels, out_channels, text_dim" in lacking
    (tmp_path / "shards").mkdir()
    problems = check_video_latents(_config(tmp_path / "shards"), StubVideoConfig())
    assert "manifest.json cannot be read" in problems[0]


def test_a_bad_recipe_fails_at_launch_before_workers_start(tmp_path, capsys):
    from veomni.launch import main

    write_split(tmp_path / "split", samples=5, shards=1)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model:\n  arch: stub_video_latents_reader\n  plugins: []\n"
                      f"data:\n  train_path: {tmp_path / 'split'}\n  tokens_per_micro_batch: 40\n"
                      f"train:\n  output_dir: {tmp_path / 'out'}\n")
    assert main([str(recipe)]) == 2
    err = capsys.readouterr().err
    assert re.search(r"config error: data\.train_path: the largest latent .* is 48 patches of \[1, 2, 2\], more "
                     r"than data\.tokens_per_micro_batch=40", err), err
    assert main([str(recipe), "--data.tokens_per_micro_batch", "48"]) == 0
