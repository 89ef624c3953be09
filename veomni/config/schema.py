"""Typed schema of a run: one dataclass per YAML section.

Every field has a default so a recipe only states what differs. The ``model`` section is open
(its keys are checked against the registered model's own config dataclass), every other
section is closed: an unknown key is an error, reported with file, line and nearest key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from veomni.config.objective_settings import PreferenceConfig, RLConfig  # noqa: F401 - part of the schema
from veomni.config.optim_schema import OptimConfig, ParamGroupConfig  # noqa: F401 - part of the schema


@dataclass
class SourceConfig:
    """One weighted training source of ``data.sources``."""

    path: str = ""
    """Folder of webdataset ``.tar`` shards, a ``.jsonl`` file, or a folder of ``.jsonl`` files."""
    weight: float = 1.0
    """Share of the samples drawn from this source (weights are normalised; 0 pauses the source)."""
    name: str = ""
    """Name in metrics and checkpoints (``mix_<name>``); empty takes the folder or file name."""
    format: Literal["", "auto", "webdataset", "jsonl"] = ""
    """Empty takes ``data.format``."""
    text_key: str = ""
    """Empty takes ``data.text_key``."""
    prepare: str | None = None
    """Builder run once before training when ``path`` is missing (as ``data.prepare``, writing its
    held-out split beside it: ``eval`` next to a folder named ``train``)."""
    prepare_args: list[str] = field(default_factory=list)


@dataclass
class DataConfig:
    kind: str = ""
    """Registered dataset kind to read (``packed_text``, ``chat_text``, ``chat_media``, or a plugin's); empty
    takes the one the model family's spec names."""
    train_path: str = ""
    """Folder of webdataset ``.tar`` shards, a ``.jsonl`` file, or a folder of ``.jsonl`` files."""
    sources: list[SourceConfig] = field(default_factory=list)
    """Several training sources mixed per sample by weight (instead of ``train_path``), e.g.
    ``[{path: data/text, weight: 0.7}, {path: data/vqa, weight: 0.3}]``; each keeps its own position
    in checkpoints, and weights may change at a resume. See docs/data.md, "Mixtures"."""
    eval_path: str | None = None
    """Held-out split in the same formats; eval is skipped when unset."""
    prepare: str | None = None
    """Builder script run once before training when a data path is missing; called as
    ``python PREPARE --train-out TRAIN_PATH --eval-out EVAL_PATH [PREPARE_ARGS...]``."""
    prepare_args: list[str] = field(default_factory=list)
    """Extra arguments for ``data.prepare`` (e.g. ``[--kind, sbm, --nodes, "2000"]``): one builder
    serves several recipes."""
    format: Literal["auto", "webdataset", "jsonl"] = "auto"
    text_key: str = "txt"
    """Key of the text field: the member suffix in webdataset shards, the JSON key in jsonl."""
    chat_markup: Literal["plain", "model"] = "plain"
    """``chat_media`` kind: how turns are written around their contents: ``plain`` (``User: ...``,
    ``Assistant: ...<eos>``) or ``model`` (the model family's own, e.g. Qwen-VL's ``<|im_start|>``)."""
    tokenizer: str = ""
    """Folder loadable by ``transformers.AutoTokenizer.from_pretrained`` (offline); needed only
    by dataset kinds that read text. Unset: the ``checkpoint.init_from_hf`` folder, if it holds one."""
    vae: str = ""
    """``video_clips`` kind: folder of the frozen diffusers VAE (``AutoencoderKL`` or
    ``AutoencoderKLWan``) that encodes each clip on the fly."""
    text_encoder: str = ""
    """``video_clips`` kind: folder of the frozen transformers text encoder and its tokenizer that
    encodes each caption on the fly."""
    max_seq_len: int = 1024
    """Text kinds: longest sample in tokens; longer documents are cut into consecutive chunks of
    this length (checked by the kind: >= 2 and <= ``tokens_per_micro_batch``)."""
    tokens_per_micro_batch: int = 4096
    """Budget of one micro-batch in the task's units (dynamic batch size): tokens for text kinds,
    rows for a kind whose unit is a sample."""
    num_workers: int = 0
    shuffle: bool = True
    """Shuffle the shard order every epoch, and samples within a window of ``shuffle_window`` records."""
    shuffle_window: int = 256
    """Records read ahead and passed on in a seeded random order (held in memory: lower it for large
    media records); a resume re-reads at most one window. 1 keeps the read order."""
    balance: bool = False
    """Give every data-parallel rank an equal share of estimated compute each micro-batch (attention
    is quadratic in length, encoders cost by patches; the family's cost model says how much), by
    reordering samples within groups of ranks. See docs/data.md, "Balancing ranks"."""
    balance_group: int = 0
    """Data-parallel ranks that reorder samples among themselves; 0 takes the ranks of one node.
    Must divide the data-parallel size."""
    balance_max_wait: int = 4
    """Steps a sample may wait in its rank's window before it is placed whatever the balance."""
    max_bad_fraction: float = 0.01
    """Bad records are skipped and counted; above this fraction the run stops."""
    graph_partitioner: Literal["auto", "metis", "bfs", "index"] = "auto"
    """Graph kinds: how nodes are split into data-parallel partitions and each partition into
    chunks (``train.grad_accum`` of them): ``metis`` when a METIS binding is installed, ``bfs``
    (locality-aware, pure torch), ``index`` (contiguous ids); ``auto`` takes metis, else bfs."""
    graph_chunk_order: Literal["shuffled", "fixed"] = "shuffled"
    """Graph kinds: the order chunks run in each epoch (``shuffled``: seeded per epoch, so no chunk
    always reads the stalest history)."""
    graph_warmup_epochs: int = 2
    """Graph kinds with chunks: the first epochs train exactly on the whole partition (no stale
    history), which also fills the history before the first chunked epoch."""
    graph_stale_gradients: bool = True
    """Graph kinds with chunks: edges between chunks also carry gradients, one epoch late, to the
    rows they read from the history (``veomni.parallel.graph.halo.StaleGradients``); off, such edges
    train only their target side."""
    graph_refresh_every: int = 10
    """Graph kinds with chunks: every this many epochs one epoch trains exactly on the whole
    partition, refreshing every history row; 0: only the warm-up epochs do."""
    graph_fanouts: list[int] = field(default_factory=list)
    """Graph kinds: sampled mini-batch training (GraphSAGE / PyG ``NeighborLoader``'s
    ``num_neighbors``): in-neighbours sampled per node at each hop, hop 1 first, one entry per
    message-passing layer, -1 for all of them; empty trains on the whole graph. See docs/gnn.md."""
    graph_batch_size: int = 1024
    """Sampled graph training: target (training) nodes per mini-batch per rank; a micro-batch is one
    mini-batch, an optimizer step ``train.grad_accum`` of them."""
    graph_batch_order: Literal["random", "proximity"] = "random"
    """Sampled graph training: the targets of an epoch shuffled, or in breadth-first order from a
    seeded root (BGL's proximity-aware order: consecutive mini-batches share neighbours)."""
    graph_order_sequences: int = 1
    """Sampled graph training, ``proximity`` order: BFS sequences from independent random roots
    interleaved round-robin over the targets (BGL's randomised order: each mini-batch holds a stretch
    of every sequence, less correlated, a little less cache-friendly); 1: one BFS."""
    graph_features: Literal["memory", "mmap"] = "memory"
    """Sampled graph training: node features read into memory, or memory-mapped from the graph
    folder (only the rows the mini-batches read are paged in)."""
    graph_cache_rows: int = 0
    """Sampled graph training: feature rows cached on the training device (0: none)."""
    graph_prefetch: int = 2
    """Sampled graph training: mini-batches sampled and gathered ahead on a background thread,
    overlapping the step (0: in the step)."""
    graph_cache_policy: Literal["fifo", "lru"] = "fifo"
    """Sampled graph training: which cached row a miss replaces (oldest inserted, least recently used)."""


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """HSDP replica groups (parameters replicated across groups, sharded within)."""
    dp_shard: int = -1
    """FSDP shard group size; -1 takes every rank not used by another dimension."""
    sp: int = 1
    """Ulysses sequence-parallel group size: ranks that split each packed row; must divide
    the attention heads. Parameters are sharded over dp_shard x cp x sp."""
    cp: int = 1
    """Context-parallel group size (ring attention / Mesh-Attention): ranks that split each packed
    row outside Ulysses, with no head limit; sp x cp ranks hold one row. See docs/context_parallel.md."""
    cp_mesh: list[int] = field(default_factory=list)
    """[a, b] with a x b = cp: Mesh-Attention's tile grid (a ranks share query chunks, b ranks ring
    key/value chunks); [1, cp] is ring attention. Empty picks the shape with the least predicted
    attention time from the model's head counts and the link bandwidth measured at start-up."""
    ep: int = 1
    """Expert parallelism: the experts of each MoE layer are split over groups of ``ep`` ranks
    (carved out of ``dp_shard``; must divide it and the model's expert count). Inside a group the
    ranks still see different data; the ``dp_shard / ep`` ranks holding the same experts shard
    them further with FSDP."""
    pp: int = 1
    """Pipeline-parallel stages (outermost mesh dim): each stage's ranks hold a contiguous run of
    blocks (plus the embedding on the first, the head on the last) and are an FSDP/EP layout of
    their own over world / pp ranks. See docs/pipeline.md."""
    pp_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
                         "DualPipeV"] = "1F1B"
    """Pipeline schedule from ``torch.distributed.pipelining``; the last four hold several stages per
    rank (``pp_virtual_stages``)."""
    pp_virtual_stages: int = 0
    """Stages per rank: 0 picks 1 for GPipe/1F1B and 2 for the others; ZBVZeroBubble and DualPipeV
    need exactly 2 (the V layout)."""
    pp_microbatches: int = 0
    """Pipeline micro-batches per step; 0 = ``train.grad_accum`` (one loader micro-batch each).
    Must divide ``train.grad_accum``: each pipeline micro-batch packs grad_accum / pp_microbatches
    loader micro-batches into one row."""
    pp_layer_split: list[int] = field(default_factory=list)
    """Blocks per stage (pp x virtual stages entries, summing to the model's blocks); empty balances
    stages by parameter count (the embedding counts on the first stage, the head on the last)."""
    mixed_precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 params with fp32 reduction on GPU, fp32 on CPU."""
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """selective keeps matmul/attention outputs and recomputes the cheap element-wise ops."""
    compile: bool = False
    """torch.compile each block (the plan's ``blocks``)."""
    encoder_balance: bool = False
    """Models with media encoders: spread each micro-batch's media items over the data-parallel
    ranks by encoder cost and send the features back (``veomni/parallel/media/colocate.py``); the loss
    and gradients are unchanged. Under parallel.pp > 1 (encoder_colocate) over all pp x dp
    ranks. Not with parallel.cp, nor with pp > 1 and encoder_colocate false."""
    encoder_sp: int = 1
    """Models with media encoders: long-short sequence parallelism. A media item with more than
    ``encoder_sp_threshold`` encoder sequence rows (ViT patches, audio tokens) runs Ulysses-style
    over a block of ``encoder_sp`` consecutive ranks, each holding a share of its rows; shorter
    items run whole on one rank, in the same step (``veomni/parallel/media/encoder_sp.py``). Must divide
    dp x sp (pp x dp under a pipeline colocating the encoders) and the encoders' attention heads;
    1 = off. Not with parallel.cp, nor with pp > 1 and encoder_colocate false."""
    encoder_sp_threshold: int = 0
    """Encoder sequence rows above which an item is long (with ``encoder_sp`` > 1); at least
    ``encoder_sp`` x the encoder's rows per feature (the ViT: ``merge_size**2`` patches)."""
    encoder_fsdp: int = 0
    """Models with media encoders: ranks that shard each encoder's parameters (its own FSDP group,
    beside the LLM's); the other ranks of the stage replicate them (HSDP). 0 = the LLM's sharding
    (dp_shard x cp x sp). A small encoder at 1 is replicated: one gradient all-reduce per step and
    no parameter all-gathers. Must divide dp_shard x cp x sp. Under parallel.pp > 1 with
    encoder_colocate the encoders' mesh spans every pp x dp rank: k must divide pp x dp, 0 shards
    over all of them."""
    encoder_colocate: bool = True
    """Models with media encoders under parallel.pp > 1: the encoders live on every pipeline rank
    and encode the step's media before the schedule runs, the items spread over the pipeline's
    ranks, their backward after it
    (``veomni/parallel/media/pipeline_encoders.py``); false runs them inside the first stage (the
    baseline the bubble benchmark compares with)."""


@dataclass
class TrainConfig:
    output_dir: str = "outputs/run"
    max_steps: int = 100
    seed: int = 42
    grad_accum: int = 1
    """Micro-batches per rank per optimizer step."""
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    """0 disables clipping (the norm is still reported)."""
    optimizer: str = "adamw"
    """A registered optimizer (``adamw``, ``sgd``, ``muon``, or a plug-in's); see docs/optimizers.md."""
    eval_interval: int = 0
    """Steps between evaluations on ``data.eval_path``; 0 evaluates only at the end."""
    eval_batches: int = 8
    """Micro-batches of the held-out set each data-parallel rank scores per eval (how much is scored
    then depends on the process count); 0 scores the whole held-out set, the same samples at any
    process count (a rank whose share ends first runs uncounted repeats to keep the collectives in
    step). The summary states how many samples an eval covered."""
    sample_prompt: str | None = None
    """If set, print a continuation of this prompt after training."""
    sample_tokens: int = 48
    sample_temperature: float = 0.8
    """0 decodes greedily; otherwise top-k sampling at this temperature (seeded by train.seed)."""
    sample_top_k: int = 40
    sample_interval: int = 0
    """Steps between validation samples of a generative family (its ``SampleWriter``: clips and a
    contact sheet under ``<output_dir>/samples/``, also logged to wandb / TensorBoard), and one at
    the end of the run; 0 writes none."""
    ema_decay: float = 0.0
    """Keep an exponential moving average of the weights with this decay (e.g. 0.999), saved in
    checkpoints and used for samples; 0 keeps none."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_restarts: int = 3
    """Times ``scripts/train.sh`` restarts the worker group after a worker dies (torchrun's elastic
    restart); each restart resumes from the newest verified checkpoint of the run. 0: a dead worker
    ends the run. See docs/fault_tolerance.md."""
    collective_timeout_s: float = 600.0
    """A rank that makes no progress (no step, eval or checkpoint phase finished) for this long dumps
    the collective it is waiting in and its stack, and the run fails fast so the restart can act."""
    straggler_factor: float = 1.5
    """A rank whose step time, averaged over ``straggler_window`` steps, exceeds the median rank's by
    this factor is named in the log and in metrics; 0 turns the check off."""
    straggler_window: int = 10
    """Steps whose per-rank times are averaged before ranks are compared."""
    shared_fs_timeout_s: float = 60.0
    """At start-up every rank must see a marker rank 0 writes in ``output_dir`` within this many
    seconds (checkpoints need one filesystem shared by all nodes), or the run stops before training."""
    loss_spike_factor: float = 0.0
    """A step whose loss exceeds this multiple of the mean of the last ``loss_spike_window`` good
    steps is skipped like a non-finite one (no optimizer or scheduler step, on every rank); 0 skips
    only non-finite losses and gradient norms."""
    loss_spike_window: int = 20
    """Good steps the loss-spike reference averages; the spike check starts once this many are seen."""
    max_bad_steps: int = 3
    """Consecutive skipped steps after which ``on_bad_steps`` acts."""
    objective: str = "sft"
    """What the run optimises (``veomni/objectives/``): ``sft`` the family's own loss; ``dpo``, ``ipo``,
    ``simpo`` preference optimisation on pairs (the ``preference`` section, docs/post_training.md); ``grpo``
    online RL with verifiable rewards (the ``rl`` section); a
    plug-in may register more."""
    on_bad_steps: Literal["rollback", "stop"] = "rollback"
    """``rollback``: reload the newest checkpoint and go on with the data after the bad window (stops
    when there is no checkpoint, or when the bad steps recur before a newer one is saved); ``stop``:
    end the run with a message naming the steps."""


@dataclass
class CheckpointConfig:
    interval: int = 0
    """Steps between saves; 0 saves only at the end."""
    resume: str = "auto"
    """``auto`` (newest complete checkpoint in output_dir, if any), ``none``, or a path."""
    keep_last: int = 2
    async_save: bool = False
    save_final: bool = True
    init_from_hf: str | None = None
    """Hugging Face folder to initialise the whole model from when not resuming. Every model option the
    recipe does not set is read from its ``config.json`` (``veomni/config/pretrained.py``), and its
    tokenizer is ``data.tokenizer`` when that is unset."""
    prepare: str | None = None
    """Builder of ``init_from_hf`` (else of the ``init`` folders, ``FOLDER`` being their common parent):
    the launcher runs ``python SCRIPT --out FOLDER [prepare_args]`` before its checks when a folder is
    missing or holds a builder's ``manifest.json`` (which the builder keeps when current), e.g.
    ``data/build_qwen_vl_random.py``; a dry run builds nothing and says so for a missing folder."""
    prepare_args: list[str] = field(default_factory=list)
    """Extra arguments for ``checkpoint.prepare`` (``[qwen3_tiny]``: which folder
    ``data/build_random_pretrained.py`` writes)."""
    init: dict[str, str] = field(default_factory=dict)
    """Sub-module path -> local pretrained folder loaded into it when not resuming, after the seeded
    init (``llm: /ckpt/Qwen3-0.6B``, ``encoders.image: /ckpt/qwen2vl-vision``): a Hugging Face /
    diffusers folder (its config must equal the sub-module's) or safetensors in our own names."""


@dataclass
class LogConfig:
    interval: int = 1
    wandb: bool = False
    """Logs to wandb; offline unless WANDB_API_KEY is set."""
    wandb_project: str = "veomni-zoo"
    tensorboard: bool = False
    progress_bar: bool = True


@dataclass
class LoraConfig:
    """Low-rank adapters (LoRA) on a frozen base, applied from outside like the parallel recipes
    (``veomni/adapters/lora.py``, docs/lora.md). ``rank`` 0 trains the whole model."""

    rank: int = 0
    """Adapter rank r; 0 turns LoRA off."""
    alpha: float = 16.0
    """The adapters' output is scaled by ``alpha / rank`` (``alpha / sqrt(rank)`` with ``rslora``)."""
    rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    """Per-layer ranks, PEFT's ``rank_pattern``: pattern (as in ``targets``) -> rank; the first key
    matching an adapted linear layer gives its rank, the others take ``rank``."""
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    """Per-layer alphas, PEFT's ``alpha_pattern``, as ``rank_pattern``."""
    dropout: float = 0.0
    """Dropout on the adapters' input (training only)."""
    targets: list[str] = field(default_factory=list)
    """Modules to adapt: a name without dots matches a module's last path segment (``q_proj``,
    ``experts``), a dotted pattern its whole path (``llm.layers.*.attn.q_proj``, ``*`` = one
    segment). Linear layers get one adapter, grouped experts one per expert. Empty: every linear
    layer and expert group inside the model's blocks (no embedding, no head)."""
    train: list[str] = field(default_factory=list)
    """Modules trained whole beside the adapters (e.g. ``[projector]``), by the same patterns."""
    init_from_peft: str = ""
    """A PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) whose
    adapters this run starts from, when not resuming; its rank, alpha and targets must match."""
    base_dtype: Literal["auto", "bf16", "fp32"] = "auto"
    """Storage of the frozen base: auto keeps it in bf16 on a GPU under bf16 compute, fp32 on CPU."""


@dataclass
class ModelConfig:
    """``arch`` picks a registered model family; ``plugins`` lists the packages that register
    families (module names or package folders, see ``veomni.contract.load_plugins``); the remaining
    keys belong to the family's config dataclass."""

    arch: str = "llm"
    plugins: list[str] = field(default_factory=lambda: ["models"])
    options: dict[str, Any] = field(default_factory=dict)
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Where each ``model.`` key was set (``"model.encoders.image.num_layers"`` -> ``"r.yaml:24"`` or
    the CLI flag), filled by the loader: errors from the model config's own validation, which the
    loader cannot run, still point at the line or flag to fix. Not compared, not saved."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    rl: RLConfig = field(default_factory=RLConfig)
