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
class ModelConfig:
    """Architecture of the Qwen3-style decoder (a preset from ``configs/model``)."""

    name: str = "tiny"
    num_layers: int = 4
    hidden_size: int = 128
    ffn_hidden_size: int = 352
    num_attention_heads: int = 4
    num_query_groups: int = 2
    """KV heads; ``num_attention_heads / num_query_groups`` is the GQA group size G."""
    head_dim: Optional[int] = None
    """Defaults to ``hidden_size / num_attention_heads``."""
    vocab_size: int = 50304
    """Rounded up to a multiple of ``make_vocab_size_divisible_by * tp`` for the embedding."""
    make_vocab_size_divisible_by: int = 128
    seq_length: int = 2048
    init_std: float = 0.02
    norm_epsilon: float = 1e-6
    """The papers omit it; 1e-6 is Qwen3's value."""
    rotary_base: float = 10000.0
    qk_layernorm: bool = True
    norm_position: str = "pre"
    """``pre`` (default) or ``post`` (post-norm blocks; MoDA reports they suit it)."""
    n_loops: int = 1
    """Looped transformer: the layer stack is applied ``n_loops`` times with shared weights."""


@dataclass
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    vp: Optional[int] = None
    """Virtual pipeline stages per pipeline rank (interleaved 1F1B); None = plain 1F1B."""
    dp: Optional[int] = None
    """Data-parallel size; derived as world / (tp * pp) when None, checked when set."""
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    recompute: str = "none"
    """``none`` or ``full`` (every layer re-runs in backward, depth mixing included)."""
    world_size: Optional[int] = None
    """Expected number of processes. When set, a launch with another world size is refused;
    ``train.dry_run`` plans for it (else ``$WORLD_SIZE``, else 1)."""
    use_cpu_initialization: bool = True
    """Initialise full weights on the CPU with one seed per layer, then shard: the same
    seed gives the same model at every TP/PP layout (slower start-up at 3B scale)."""


@dataclass
class DataConfig:
    name: str = "embedded"
    prefixes: list[Any] = field(default_factory=list)
    """Megatron data prefixes (``path/to/doc`` for ``doc.bin/.idx``), optionally
    interleaved with blend weights: ``[0.3, a, 0.7, b]``. Empty = the embedded corpus."""
    tokenizer: Optional[str] = None
    """Path to a Hugging Face ``tokenizers`` JSON file (required with ``prefixes``)."""
    split: str = "98,2,0"
    cache_dir: Optional[str] = None
    """Where dataset index caches (and the embedded corpus) are written."""
    embedded_documents: int = 4000
    embedded_vocab_size: int = 2048
    eod_mask_loss: bool = False
    num_workers: int = 0


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 16
    steps: int = 200
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_fraction: float = 0.02
    lr_decay_style: str = "cosine"
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    precision: str = "fp32"
    """``fp32``, ``bf16`` or ``fp16`` (fp16 uses dynamic loss scaling)."""
    initial_loss_scale: float = 2.0**16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 4
    save_interval: int = 0
    """Save a checkpoint every N steps (0 = only at the end of training and on preemption)."""
    save_dir: Optional[str] = None
    """Where checkpoints go; default ``<output_dir>/checkpoints``."""
    load_dir: Optional[str] = None
    """Resume from this directory (its latest checkpoint) or one ``iter_*`` checkpoint;
    default: ``save_dir`` when it holds a checkpoint, else start fresh."""
    keep_last: int = 2
    """Keep the newest N checkpoints (0 = keep all)."""
    load_optimizer: bool = True
    """False: load weights only and start a new run (fresh optimizer, schedule, data, step)."""
    ckpt_optim_format: str = "dp_reshardable"
    """Distributed-optimizer state layout in checkpoints: ``dp_reshardable`` (fast, fully
    parallel; reloads at the same TP/PP/VP, any DP) or ``fully_reshardable`` (gathered on
    DP rank 0 when saving; reloads into any layout)."""
    ckpt_fully_parallel: bool = True
    """Spread saving/loading of replicated tensors over the data-parallel ranks."""
    save_on_preemption: bool = True
    """On SIGTERM/SIGUSR1 (and submitit's signal): finish the step, save, exit 0."""
    exit_after_steps: Optional[int] = None
    """Stop after this many steps of this invocation (resume tests, time-boxed jobs)."""
    dry_run: bool = False
    """Print the resolved config, parallel layout and per-rank memory estimate, then exit
    (no model, no process group). World size: ``parallel.world_size`` or ``$WORLD_SIZE``."""
    peak_tflops: Optional[float] = None
    """Per-device peak dense TFLOP/s for MFU; None = look the device up in a table
    (``depthmix.pretrain.accounting.PEAK_TFLOPS``); no MFU when unknown (e.g. CPU)."""
    verbose: bool = False
    """Show what the libraries print at start-up: every Megatron-Core / Apex / Transformer
    Engine warning, Megatron's config dumps and bucket lists, W&B's messages. Default: one
    summary line for the warnings, the rest only at debug level."""
    profile_steps: Optional[list[int]] = None
    """``[first, last]``: record a torch profiler trace of these steps (inclusive) into
    ``<output_dir>/profile/`` (Chrome trace JSON per rank; on CUDA also a memory snapshot)."""


@dataclass
class LoggerConfig:
    wandb: bool = True
    mode: str = "offline"
    """``offline`` (default), ``online`` or ``disabled``."""
    project: str = "depthmix"
    entity: Optional[str] = None
    name: Optional[str] = None
    dir: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    depth_stats_interval: int = 0
    """Log per-layer depth-mixing weights every N steps (0 = never): one extra no-grad
    forward over the first validation micro-batch(es), heatmaps + scalars to W&B and PNGs
    under ``<output_dir>/depth_stats``."""
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
