"""The run configuration as typed dataclasses.

Hydra composes YAML files from ``depthmix/configs``; :func:`depthmix.config.load.resolve`
merges the result onto these dataclasses (unknown keys and wrong types fail there) and
:func:`depthmix.config.validate.validate` checks the cross-field rules. Every error is a
:class:`ConfigError` whose message names the option to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


class ConfigError(ValueError):
    """A configuration that cannot work. The message names the offending option."""


@dataclass
class MoEConfig:
    """Mixture-of-experts MLPs (Megatron-Core's ``MoELayer``) in place of the dense SwiGLU MLP
    on some layers (``model.moe``; null: a dense model). docs/moe.md."""

    num_experts: int = 0
    """Routed experts per MoE layer. 0: no experts (a dense model); set it to turn experts on
    for a dense preset (``model.moe.num_experts=8``)."""
    top_k: int = 2
    """Experts each token is routed to."""
    ffn_hidden_size: Optional[int] = None
    """SwiGLU inner width of one routed expert; None: ``model.ffn_hidden_size``."""
    shared_expert_ffn_hidden_size: int = 0
    """Inner width of the shared expert every token also goes through (DeepSeek-V3, Kimi);
    several shared experts of width w are one of width (count * w). 0: none."""
    first_dense_layers: int = 0
    """The first k layers keep the dense MLP (DeepSeek-V3: 3 of 61; Kimi K2: 1 of 61)."""
    layer_freq: int = 1
    """After the first dense layers, every n-th layer is an MoE layer (1: all of them)."""
    score_function: str = "softmax"
    """Router scores: ``softmax`` over the experts (Switch Transformer, GShard, Qwen3-MoE) or
    ``sigmoid`` per expert (DeepSeek-V3)."""
    normalize_top_k: bool = True
    """The k selected weights are renormalised to sum to 1 (Qwen3-MoE's ``norm_topk_prob``,
    DeepSeek-V3); false: each is its softmax probability over all experts (Switch
    Transformer; softmax only, needed for ``top_k=1``)."""
    routed_scaling_factor: Optional[float] = None
    """Multiply the routed experts' weights by this (DeepSeek-V3: 2.5); None: 1."""
    aux_loss_coeff: float = 1e-2
    """Weight of the load-balancing auxiliary loss (Switch Transformer's
    ``E * sum_i f_i P_i``); 0: none."""
    aux_loss_scope: str = "batch"
    """``batch``: the auxiliary loss over each micro-batch's tokens (Switch, GShard);
    ``sequence``: per sequence, averaged (DeepSeek-V3's complementary sequence-wise loss)."""
    expert_bias: bool = False
    """DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores for
    the top-k choice only, moved by ``expert_bias_update_rate`` towards balance once per
    optimizer step (needs ``score_function=sigmoid``)."""
    expert_bias_update_rate: float = 1e-3
    """Step of the expert-bias update (DeepSeek-V3's gamma, 0.001)."""
    z_loss_coeff: float = 0.0
    """Weight of the router z-loss, the mean squared log-sum-exp of the router logits
    (ST-MoE; 1e-3 there); 0: none."""
    dropless: bool = True
    """Every routed token reaches its experts. false: each expert takes at most
    ``capacity_factor * tokens * top_k / num_experts`` tokens of a micro-batch, the rest are
    dropped (the shared expert and the residual still carry them)."""
    capacity_factor: Optional[float] = None
    """Expert capacity with ``dropless=false`` (GShard, Switch Transformer: 1.0-2.0). An
    expert over capacity drops the assignments of the lowest weights (Megatron's ``probs``
    policy; its ``position`` policy does not keep the first tokens, so it is not offered)."""

    experts_impl: str = "auto"
    """How the routed experts run: ``sequential`` (Megatron's ``SequentialMLP``, one expert
    after the other: the reference and the CPU path), ``grouped`` (fc1 and fc2 of all local
    experts as one ``torch._grouped_mm`` each; the same parameters, a checkpoint of either
    loads in the other) or ``auto`` (grouped on CUDA, else sequential). Resolved once at
    start-up and logged."""

    def is_moe_layer(self, layer: int) -> bool:
        """Whether (0-based, unique) layer ``layer`` has experts."""
        after = layer - self.first_dense_layers
        return self.num_experts > 0 and after >= 0 and after % self.layer_freq == 0

    def expert_ffn_hidden_size(self, model: "ModelConfig") -> int:
        return self.ffn_hidden_size or model.ffn_hidden_size


@dataclass
class ModelConfig:
    """Architecture of the Qwen3-style decoder (a preset from ``configs/model``)."""

    name: str = "tiny"
    """Preset name (``configs/model/<name>.yaml``); used in output directory names."""
    num_layers: int = 4
    """Transformer layers (each: attention and MLP sublayers)."""
    hidden_size: int = 128
    """Model width ``d``."""
    ffn_hidden_size: int = 352
    """SwiGLU MLP inner width."""
    num_attention_heads: int = 4
    """Query heads ``H``."""
    num_query_groups: int = 2
    """KV heads; ``num_attention_heads / num_query_groups`` is the GQA group size G."""
    head_dim: Optional[int] = None
    """Defaults to ``hidden_size / num_attention_heads`` (:attr:`kv_channels`)."""
    vocab_size: int = 50304
    """Rounded up to a multiple of ``make_vocab_size_divisible_by`` for the embedding
    (:attr:`padded_vocab_size`)."""
    make_vocab_size_divisible_by: int = 128
    """Pad the embedding and output layer to a multiple of this (Megatron-LM's default
    128)."""
    seq_length: int = 2048
    """Tokens per training sample."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of every weight."""
    norm_epsilon: float = 1e-6
    """The papers omit it; 1e-6 is Qwen3's value."""
    rotary_base: float = 10000.0
    """RoPE base frequency."""
    qk_layernorm: bool = True
    """RMSNorm of queries and keys per head (Qwen3)."""
    norm_position: str = "pre"
    """``pre`` (default) or ``post`` (post-norm blocks; MoDA reports they suit it)."""
    n_loops: int = 1
    """Looped transformer: the layer stack is applied ``n_loops`` times with shared weights."""
    tie_embeddings: bool = False
    """One matrix for the input embedding and the output layer (most small Qwen3 and Llama
    models; the papers' presets keep them separate)."""
    moe: Optional[MoEConfig] = field(default_factory=MoEConfig)
    """Mixture-of-experts layers (``model.moe.<option>``, listed below); without experts
    (``model.moe.num_experts=0``, or null) every MLP is dense."""

    @property
    def experts(self) -> Optional[MoEConfig]:
        """``moe`` when it has experts, else None (dense)."""
        return self.moe if self.moe is not None and self.moe.num_experts > 0 else None

    @property
    def kv_channels(self) -> int:
        """Width of one attention head (Megatron's name)."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the output layer. Not a multiple of TP: the padded
        size, hence the initial weights, must not depend on the layout (validation checks
        that it divides by TP)."""
        multiple = self.make_vocab_size_divisible_by
        return (self.vocab_size + multiple - 1) // multiple * multiple


@dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (stages)."""
    vp: Optional[int] = None
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B); None = plain 1F1B."""
    dp: Optional[int] = None
    """Data-parallel size; derived as world / (tp * pp) when None, checked when set."""
    ep: int = 1
    """Expert-parallel size: the routed experts of each MoE layer are split over this many
    ranks of a pipeline stage, each holding ``num_experts / ep`` of them (needs
    ``model.moe``; ``ep * expert_tp * pp`` divides the world size)."""
    expert_tp: Optional[int] = None
    """Tensor-parallel size of the experts: 1 (each expert whole on its rank) or ``tp`` (its
    weights split like the dense MLP's); None: ``tp``. The ranks of a pipeline stage form
    ``expert_tp x ep x`` expert-data-parallel groups, which reduce the experts' gradients."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs ``tp > 1``)."""
    distributed_optimizer: bool = False
    """Shard optimizer state over the data-parallel ranks (ZeRO-1)."""
    overlap_grad_reduce: Optional[bool] = None
    """Overlap the data-parallel gradient reduction with the backward pass (bucket by
    bucket, as Megatron-LM's ``--overlap-grad-reduce``). None: on when the data-parallel
    size is above 1 (docs/operations.md, "Overlapped data-parallel communication")."""
    overlap_param_gather: Optional[bool] = None
    """Overlap the distributed optimizer's parameter all-gather with the next forward pass
    (needs ``distributed_optimizer`` and ``overlap_grad_reduce``). None: on when both are."""
    align_grad_reduce: bool = True
    """With pipeline parallelism: every stage launches its gradient reduction from the
    schedule (Megatron-LM's default); false: each stage as soon as its backward is done."""
    align_param_gather: bool = False
    """With pipeline parallelism: the schedule launches each chunk's parameter all-gather
    (Megatron-LM's ``--align-param-gather``); false: the first forward pre-hook does."""
    ddp_bucket_size: Optional[int] = None
    """Parameters per gradient-reduction bucket when overlapping; None: Megatron's default,
    max(40M, 1M x data-parallel size)."""
    recompute: str = "none"
    """``none`` or ``full`` (every layer re-runs in backward, depth mixing included)."""
    world_size: Optional[int] = None
    """Expected number of processes. When set, a launch with another world size is refused;
    ``train.dry_run`` plans for it (else ``$WORLD_SIZE``, else 1)."""
    use_cpu_initialization: bool = True
    """Initialise full weights on the CPU with one seed per layer, then shard: the same
    seed gives the same model at every TP/PP layout (slower start-up at 3B scale)."""


@dataclass(frozen=True)
class Overlap:
    grad_reduce: bool
    param_gather: bool


def overlap_at(parallel: ParallelConfig, dp: int,
               distributed_optimizer: Optional[bool] = None) -> Overlap:
    """What ``parallel``'s overlap options mean at data-parallel size ``dp`` (None: on when it
    helps: gradients when there are replicas to reduce over, parameters when the distributed
    optimizer has shards to gather). The trainer and the planner both read them here."""
    distopt = parallel.distributed_optimizer if distributed_optimizer is None \
        else distributed_optimizer
    grad = parallel.overlap_grad_reduce
    grad = dp > 1 if grad is None else grad
    param = parallel.overlap_param_gather
    param = grad and distopt if param is None else param
    return Overlap(grad_reduce=bool(grad), param_gather=bool(param))


@dataclass
class DataConfig:
    name: str = "embedded"
    """``embedded`` (the generated corpus) or a dataset preset (``configs/data``)."""
    prefixes: list[Any] = field(default_factory=list)
    """Megatron data prefixes (``path/to/doc`` for ``doc.bin/.idx``), optionally
    interleaved with blend weights: ``[0.3, a, 0.7, b]``. Empty = the embedded corpus."""
    tokenizer: Optional[str] = None
    """Path to a Hugging Face ``tokenizers`` JSON file (required with ``prefixes``)."""
    split: str = "98,2,0"
    """Train, validation and test shares of the documents: one to three non-negative numbers
    with a positive sum, e.g. ``98,2,0``."""
    cache_dir: Optional[str] = None
    """Where dataset index caches (and the embedded corpus) are written."""
    embedded_documents: int = 4000
    """Documents in the embedded corpus."""
    embedded_vocab_size: int = 2048
    """BPE vocabulary of the embedded corpus's tokenizer (>= 258, <=
    ``model.vocab_size``)."""
    eod_mask_loss: bool = False
    """Exclude end-of-document tokens from the loss."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0 = load in the training process)."""


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    """Samples per forward/backward on one data-parallel rank."""
    global_batch_size: int = 16
    """Samples per optimizer step, over all data-parallel ranks and micro-batches."""
    steps: int = 200
    """Optimizer steps of the whole run (also the length of the LR schedule)."""
    lr: float = 3e-3
    """Peak learning rate (> 0)."""
    min_lr: float = 3e-4
    """Learning rate at the end of the decay (0 <= min_lr <= lr)."""
    warmup_fraction: float = 0.02
    """Fraction of ``steps`` spent in linear warmup, in [0, 1) (ignored when
    ``warmup_steps`` is set)."""
    warmup_steps: Optional[int] = None
    """Linear warmup over this many steps (e.g. the MoDA paper's 2k), instead of a fraction."""
    lr_decay_style: str = "cosine"
    """``cosine``, ``linear``, ``constant`` or ``inverse-square-root`` after warmup."""
    weight_decay: float = 0.1
    """AdamW weight decay (not on norms, biases or depth-mixing parameters)."""
    adam_beta1: float = 0.9
    """Adam beta1, in [0, 1)."""
    adam_beta2: float = 0.95
    """Adam beta2, in [0, 1)."""
    adam_eps: float = 1e-8
    """Adam epsilon (> 0)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16`` (fp16 uses dynamic loss scaling)."""
    initial_loss_scale: float = 2.0**16
    """fp16: starting dynamic loss scale."""
    loss_scale_window: int = 1000
    """fp16: steps without overflow before the loss scale grows."""
    min_loss_scale: float = 1.0
    """fp16: the loss scale never drops below this."""
    seed: int = 1234
    """Seed of initialisation, data order and dropout (>= 0)."""
    log_interval: int = 10
    """Print and log the training loss every N steps."""
    eval_interval: int = 100
    """Evaluate on the validation split every N steps (0 = never); also at the end of training."""
    eval_iters: int = 4
    """Global batches per evaluation."""
    save_interval: int = 0
    """Save a checkpoint every N steps (0 = only at the end of training and on preemption)."""
    save_dir: Optional[str] = None
    """Where checkpoints go; default ``<output_dir>/checkpoints``."""
    load_dir: Optional[str] = None
    """Resume from this directory (its latest checkpoint), one ``iter_*`` checkpoint, or a
    training run's or an import's output directory (its ``checkpoints/``); default:
    ``save_dir`` when it holds a checkpoint, else start fresh."""
    keep_last: int = 2
    """Keep the newest N checkpoints (0 = keep all)."""
    load_weights_only: bool = False
    """With ``train.load_dir``: load its weights only and start a new run (fresh optimizer,
    schedule, data position and step). This is the way to fine-tune from a checkpoint of
    another configuration (mixer, precision, ...) whose parameters have the same shapes;
    without it such a resume is refused at start-up, naming each differing option."""
    ckpt_integrity: str = "checksum"
    """What each checkpoint's ``depthmix.json`` records of its files, verified before loading
    (a damaged checkpoint is skipped for the previous one): ``checksum`` (size and xxHash3
    of every file: one more read of the files, spread over the ranks), ``size`` (sizes
    only; catches truncation, not overwritten bytes) or ``off``."""
    ckpt_optim_format: str = "dp_reshardable"
    """Distributed-optimizer state layout in checkpoints: ``dp_reshardable`` (fast, fully
    parallel; reloads at the same TP/PP/VP, any DP) or ``fully_reshardable`` (gathered on
    DP rank 0 when saving; reloads into any layout)."""
    ckpt_fully_parallel: bool = True
    """Spread saving/loading of replicated tensors over the data-parallel ranks."""
    async_save: bool = True
    """Write checkpoints in the background: training goes on while a forked writer saves the
    state; the checkpoint is published (tracker, checksums, retention) once every rank's
    write finished. At most one write in flight; stopping (signals, the end) waits for it.
    Falls back to synchronous saves where writers cannot be tied to the trainer's lifetime
    (not Linux, or outside a depthmix entry point)."""
    save_on_preemption: bool = True
    """On SIGTERM/SIGUSR1/SIGINT (and submitit's signal): finish the step (or eval batch),
    save, exit 0; a second SIGINT aborts without saving (exit 130)."""
    exit_after_steps: Optional[int] = None
    """Stop after this many steps of this invocation (resume tests, time-boxed jobs)."""
    dry_run: bool = False
    """Print the resolved config, parallel layout and per-rank memory estimate, then exit
    (no model, no process group). World size: ``parallel.world_size`` or ``$WORLD_SIZE``."""
    on_nonfinite: str = "skip"
    """A step whose loss or gradient norm is NaN/inf (fp16: an overflow at
    ``min_loss_scale``): ``skip`` (its update is not applied; weights and optimizer state stay
    as they were), ``stop`` (exit status 3 at once) or ``rollback`` (reload the newest healthy
    checkpoint of ``save_dir`` and continue with the data after the bad window)."""
    max_nonfinite_steps: int = 10
    """Stop with exit status 3 after this many non-finite (or vetoed spike) steps in a row
    (rollbacks count until training gets past the step that failed)."""
    spike_zscore: Optional[float] = 6.0
    """A loss more than this many standard deviations above the mean of the last
    ``spike_window`` applied steps is a spike (None = no spike detection)."""
    spike_window: int = 100
    """Steps in the loss-spike window; detection starts once the window is full."""
    on_spike: str = "log"
    """``log`` (a warning; the update is applied), ``skip`` or ``rollback`` (as for
    ``on_nonfinite``; counted towards ``max_nonfinite_steps``)."""
    peak_tflops: Optional[float] = None
    """Per-device peak dense TFLOP/s for MFU; None = look the device up in a table
    (``depthmix.planning.hardware``); no MFU when unknown (e.g. CPU)."""
    verbose: bool = False
    """Show what the libraries print at start-up: every Megatron-Core / Apex / Transformer
    Engine warning, Megatron's config dumps and bucket lists, W&B's messages. Default: one
    summary line for the warnings, the rest only at debug level."""
    compile: str = "auto"
    """``true``: ``torch.compile`` each transformer layer (regional compilation,
    :mod:`depthmix.pretrain.compile`); ``false``: eager; ``auto``: on where CUDA is, off on
    CPU (where inductor's compile time rarely pays off)."""
    fused_optimizer: str = "auto"
    """``true``: the optimizer step without per-tensor host work (torch's fused AdamW, the
    fp32-to-model weight copy as one multi-tensor op, the gradient norm and clipping on the
    device with one host read per step; :mod:`depthmix.pretrain.optim`); ``false``:
    Megatron-Core's fallbacks without Transformer Engine/Apex (``torch.optim.AdamW``, one
    copy and one norm per parameter tensor); ``auto``: on where CUDA is, off on CPU."""
    fused_cross_entropy: str = "auto"
    """``true``: output layer and cross-entropy in one chunked pass that never holds the full
    ``[tokens, vocab]`` logits (recomputed per chunk in backward;
    :mod:`depthmix.megatron_ext.loss`); ``false``: Megatron's vocab-parallel cross-entropy on
    the full fp32 logits; ``auto``: on where CUDA is, off on CPU."""
    cuda_graphs: bool = False
    """CUDA graphs around each compiled layer (``torch.compile`` mode ``reduce-overhead``:
    launches replayed from recorded graphs, no per-kernel host work). Needs a GPU and
    ``train.compile`` on."""

    def __post_init__(self):
        # the command line's true/false arrive as the strings "True"/"False"
        self.compile = str(self.compile).lower()
        self.fused_optimizer = str(self.fused_optimizer).lower()
        self.fused_cross_entropy = str(self.fused_cross_entropy).lower()
    profile_steps: Optional[list[int]] = None
    """``[first, last]``: record a torch profiler trace of these steps (inclusive) into
    ``<output_dir>/profile/`` (Chrome trace JSON per rank; on CUDA also a memory snapshot)."""


@dataclass
class LoggerConfig:
    wandb: bool = True
    """Log to Weights & Biases (rank 0)."""
    mode: str = "offline"
    """``offline`` (default), ``online`` or ``disabled``."""
    project: str = "depthmix"
    """W&B project."""
    entity: Optional[str] = None
    """W&B entity (team or user); None = your default."""
    name: Optional[str] = None
    """W&B display name; may interpolate the run config (``'logger.name=da-s${mixer.stride}'``).
    None = ``<model>-<mixer>``, plus the overrides that vary across a multirun and its short
    sweep id."""
    group: Optional[str] = None
    """W&B group; None = the sweep directory's name for a multirun, ``run.name`` (else the
    output directory's name) for one run. The run's evaluations join the same group."""
    job_type: Optional[str] = None
    """W&B job type; None = ``train`` (``depthmix-train``) or ``eval`` (``depthmix-eval``)."""
    dir: Optional[str] = None
    """Where W&B writes its files; None = the run's output directory."""
    tags: list[str] = field(default_factory=list)
    """W&B tags, added to the ``model:<name>`` and ``mixer:<name>`` tags every run has."""
    depth_stats_interval: int = 0
    """Log per-layer depth-mixing weights every N steps (0 = never): one extra no-grad
    forward over the first validation micro-batch(es), heatmaps + scalars to W&B and PNGs
    under ``<output_dir>/depth_stats``; with experts also the expert-load heatmap (each
    expert's share of its layer's tokens since the previous one, read at log steps)."""
    progress: bool = True
    """A progress bar on the logging rank when stderr is a terminal (never in batch logs)."""


@dataclass
class RunConfig:
    """Everything one training run needs. ``mixer`` is a :class:`MixerConfig` subclass."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mixer: Any = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    output_dir: str = "."
    name: Optional[str] = None
    """``run.name`` on the command line: the run's fixed output directory ``outputs/<name>``
    (re-running the same command resumes); None = a fresh directory per run."""


@dataclass
class EvalConfig:
    """``depthmix-eval``: what to evaluate and where the results go (``eval.*``)."""

    checkpoint: Optional[str] = None
    """A checkpoint directory: a ``train.save_dir`` (its latest checkpoint), one ``iter_*``
    directory, or a training run's or an import's output directory. Required. Its model
    and mixer configuration are used; any ``model=``/``mixer=`` option also given must
    agree with it."""
    datasets: Any = None
    """Name -> Megatron data prefix (``path/to/doc`` for ``doc.bin/.idx``), e.g.
    ``{pile_val: /data/pile/val_text_document}``; each is evaluated over its whole token
    stream and reported separately, then pooled (token-weighted)."""
    batch_size: int = 8
    """Windows per micro-batch on each data-parallel rank (lm-eval: requests per batch)."""
    max_windows: Optional[int] = None
    """Evaluate only the first N windows of each dataset (None = all)."""
    name: str = "eval"
    """Results go to ``<checkpoint>/eval/<name>.json`` unless ``eval.output`` is set."""
    output: Optional[str] = None
    """Path of the results JSON (default ``<checkpoint iter dir>/eval/<eval.name>.json``)."""
    tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness task or group names (single process only)."""
    num_fewshot: Optional[int] = None
    """Few-shot examples per lm-eval task (None = the task's default)."""
    limit: Optional[float] = None
    """lm-eval: at most this many documents per task (< 1: a fraction of them)."""
    include_path: Optional[str] = None
    """lm-eval: a directory of extra task YAML files."""
