"""Option checks: every impossible configuration fails here, before any model is built.

:func:`validate` runs one check per config group (``validate_model``, ``validate_parallel``,
``validate_data``, ``validate_train``, ``validate_logger``), the mixer's own
``MixerConfig.validate`` and, given the world size, the layout checks. String options
take one of the values in :data:`CHOICES` (a misspelt one is told the closest), any text
(:data:`FREE_TEXT`: names and paths), or a syntax of their own (:data:`SYNTAX`). The checks
that read files (data, tokenizer, save directory) are in :mod:`depthmix.pretrain.preflight`.
Nothing here imports torch or Megatron.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Optional, Sequence

from depthmix.config.schema import ConfigError, RunConfig

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""``train.precision`` -> the name of its torch dtype (the dtype itself:
:func:`depthmix.runtime.precision.torch_dtype`)."""
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes of one element at each ``train.precision``."""
PRECISIONS = tuple(TORCH_DTYPES)
LR_DECAY_STYLES = ("cosine", "linear", "constant", "inverse-square-root")
"""Megatron's ``OptimizerParamScheduler`` styles (``WSD`` needs options depthmix lacks)."""
CKPT_OPTIM_FORMATS = ("dp_reshardable", "fully_reshardable")
LOGGER_MODES = ("offline", "online", "disabled")
NONFINITE_POLICIES = ("skip", "stop", "rollback")
SPIKE_POLICIES = ("log", "skip", "rollback")
CKPT_INTEGRITY = ("checksum", "size", "off")
COMPILE_MODES = ("auto", "true", "false")
FAST_PATH_MODES = ("auto", "true", "false")
"""``train.fused_optimizer`` / ``train.fused_cross_entropy``: ``auto`` is on where CUDA is."""

CHOICES = {
    "model.norm_position": ("pre", "post"),
    "parallel.recompute": ("none", "full"),
    "train.precision": PRECISIONS,
    "train.lr_decay_style": LR_DECAY_STYLES,
    "train.ckpt_optim_format": CKPT_OPTIM_FORMATS,
    "logger.mode": LOGGER_MODES,
    "train.on_nonfinite": NONFINITE_POLICIES,
    "train.on_spike": SPIKE_POLICIES,
    "train.ckpt_integrity": CKPT_INTEGRITY,
    "train.compile": COMPILE_MODES,
    "train.fused_optimizer": FAST_PATH_MODES,
    "train.fused_cross_entropy": FAST_PATH_MODES,
    "model.moe.score_function": ("softmax", "sigmoid"),
    "model.moe.aux_loss_scope": ("batch", "sequence"),
    "model.moe.experts_impl": ("auto", "sequential", "grouped"),
}
"""Allowed values of the string options of the config groups (mixers: ``MixerConfig.CHOICES``)."""
FREE_TEXT = frozenset({
    "model.name", "data.name", "data.tokenizer", "data.cache_dir", "train.save_dir",
    "train.load_dir", "logger.project", "logger.entity", "logger.name", "logger.dir",
    "logger.group", "logger.job_type",
    "output_dir", "name",
})
"""String options that take any text: names (of a preset, a run, a W&B project) and paths."""
SYNTAX = frozenset({"data.split"})
"""String options with a syntax of their own, checked by their group's function."""


def nearest(value: Any, allowed: Iterable[str]) -> Optional[str]:
    """The allowed value nearest ``value``, or None when none is near."""
    match = difflib.get_close_matches(str(value), list(allowed), n=1, cutoff=0.5)
    return match[0] if match else None


def closest(value: Any, allowed: Iterable[str]) -> str:
    """``"; did you mean 'x'?"`` for the allowed value nearest ``value``, else ``""``."""
    match = nearest(value, allowed)
    return f"; did you mean {match!r}?" if match else ""


def check_choice(option: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"{option}={value!r} is not one of {', '.join(allowed)}"
                          f"{closest(value, allowed)}")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _at_least(option: str, value, low) -> None:
    _require(value >= low, f"{option}={value} must be >= {low}")


def _positive(option: str, value) -> None:
    _require(value > 0, f"{option}={value} must be > 0")


def _choices(group: str, cfg) -> None:
    for option, allowed in CHOICES.items():
        if option.startswith(f"{group}.") and option.count(".") == group.count(".") + 1:
            check_choice(option, getattr(cfg, option.rsplit(".", 1)[1]), allowed)


def split_weights(split: str) -> list:
    """``data.split`` -> three non-negative weights ``[train, valid, test]`` summing to 1.

    One to three comma-separated numbers (missing ones are 0), as Megatron reads it."""
    bad = ConfigError(f"data.split={split!r} must be one to three non-negative weights "
                      "'train,valid,test' with a positive sum, e.g. '98,2,0'")
    try:
        vector = [float(x) for x in str(split).split(",")]
    except ValueError:
        raise bad from None
    if not 1 <= len(vector) <= 3 or any(not x >= 0 for x in vector) or not sum(vector) > 0:
        raise bad
    vector += [0.0] * (3 - len(vector))
    total = sum(vector)
    return [x / total for x in vector]


def parse_blend(prefixes: list) -> tuple:
    """``[p1, p2]`` -> ``([p1, p2], None)``; ``[w1, p1, w2, p2]`` -> ``([p1, p2], [w1, w2])``."""

    def number(x) -> Optional[float]:
        if isinstance(x, bool):
            return None
        if isinstance(x, (int, float)):
            return float(x)
        try:
            return float(str(x))
        except ValueError:
            return None

    items = list(prefixes)
    if all(number(x) is None for x in items):
        return [str(x) for x in items], None
    weights, paths = items[0::2], items[1::2]
    if (len(items) % 2 or any(number(w) is None for w in weights)
            or any(number(p) is not None for p in paths)):
        raise ConfigError(f"data.prefixes={items} must be [prefix, ...] or "
                          "[weight, prefix, weight, prefix, ...]")
    w = [number(x) for x in weights]
    if any(x <= 0 for x in w):
        raise ConfigError(f"data.prefixes: blend weights {w} must all be > 0")
    return [str(p) for p in paths], w


# ------------------------------------------------------------------------ per group
def validate_model(run: RunConfig) -> None:
    m = run.model
    _choices("model", m)
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "vocab_size", "seq_length", "n_loops",
                 "make_vocab_size_divisible_by"):
        _at_least(f"model.{name}", getattr(m, name), 1)
    if m.head_dim is not None:
        _at_least("model.head_dim", m.head_dim, 1)
    for name in ("init_std", "norm_epsilon", "rotary_base"):
        _positive(f"model.{name}", getattr(m, name))
    _require(m.num_attention_heads % m.num_query_groups == 0,
             f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
             f"model.num_query_groups={m.num_query_groups}")
    if m.head_dim is None:
        _require(m.hidden_size % m.num_attention_heads == 0,
                 f"model.hidden_size={m.hidden_size} is not divisible by "
                 f"model.num_attention_heads={m.num_attention_heads}; set model.head_dim")
    if m.moe is not None:
        validate_experts(run)


def no_experts(option: str, model: str) -> str:
    """The message for an expert option given to a model without experts."""
    return (f"{option} is set but model={model} has no experts (model.moe.num_experts=0): "
            "turn them on with model.moe.num_experts=N, use a preset with experts "
            "(model=tiny_moe, ...), or drop the option")


def validate_experts(run: RunConfig) -> None:
    """``model.moe``: experts that can route (docs/moe.md)."""
    import dataclasses

    from depthmix.config.schema import MoEConfig

    m, e = run.model, run.model.moe
    if e.num_experts == 0:  # dense, unless an expert option was given
        given = [f.name for f in dataclasses.fields(MoEConfig)
                 if getattr(e, f.name) != getattr(MoEConfig(), f.name)]
        if not given:
            return
        raise ConfigError(no_experts(f"model.moe.{given[0]}={getattr(e, given[0])}", m.name))
    _choices("model.moe", e)
    _at_least("model.moe.num_experts", e.num_experts, 1)
    _require(1 <= e.top_k <= e.num_experts,
             f"model.moe.top_k={e.top_k} must be in [1, model.moe.num_experts={e.num_experts}]")
    if e.ffn_hidden_size is not None:
        _at_least("model.moe.ffn_hidden_size", e.ffn_hidden_size, 1)
    _at_least("model.moe.shared_expert_ffn_hidden_size", e.shared_expert_ffn_hidden_size, 0)
    _at_least("model.moe.layer_freq", e.layer_freq, 1)
    _require(0 <= e.first_dense_layers < m.num_layers,
             f"model.moe.first_dense_layers={e.first_dense_layers} must be in [0, "
             f"model.num_layers={m.num_layers}) (else no layer has experts)")
    for name in ("aux_loss_coeff", "z_loss_coeff"):
        _at_least(f"model.moe.{name}", getattr(e, name), 0)
    _positive("model.moe.expert_bias_update_rate", e.expert_bias_update_rate)
    if e.routed_scaling_factor is not None:
        _positive("model.moe.routed_scaling_factor", e.routed_scaling_factor)
    if e.score_function == "softmax":
        _require(e.top_k > 1 or not e.normalize_top_k,
                 "model.moe.top_k=1 with model.moe.score_function=softmax needs "
                 "model.moe.normalize_top_k=false (one renormalised weight is always 1: the "
                 "router would get no gradient)")
    else:
        _require(e.normalize_top_k, "model.moe.normalize_top_k=false needs "
                 "model.moe.score_function=softmax (sigmoid weights are renormalised)")
    _require(not e.expert_bias or e.score_function == "sigmoid",
             "model.moe.expert_bias=true needs model.moe.score_function=sigmoid (DeepSeek-V3's "
             "auxiliary-loss-free balancing biases sigmoid scores)")
    if e.experts_impl == "grouped":
        misaligned = grouped_experts_misaligned(run)
        _require(misaligned is None, f"model.moe.experts_impl=grouped: {misaligned}")
    if e.dropless:
        _require(e.capacity_factor is None,
                 f"model.moe.capacity_factor={e.capacity_factor} needs model.moe.dropless=false "
                 "(dropless experts take every token; or set model.moe.capacity_factor=null)")
    else:
        _require(e.capacity_factor is not None,
                 "model.moe.dropless=false needs model.moe.capacity_factor (e.g. 1.25)")
        _positive("model.moe.capacity_factor", e.capacity_factor)


def grouped_experts_misaligned(run: RunConfig) -> Optional[str]:
    """Why ``torch._grouped_mm`` cannot take this model's experts (its rows must be 16-byte
    aligned: the hidden size and an expert's width per tensor-parallel rank), else None."""
    m, e, tp = run.model, run.model.experts, run.parallel.tp
    elements = 16 // BYTES.get(run.train.precision, 2)
    width = e.expert_ffn_hidden_size(m)
    if m.hidden_size % elements or width % (elements * tp):
        return (f"model.hidden_size={m.hidden_size} and the expert width per rank "
                f"(model.moe.ffn_hidden_size={width} / parallel.tp={tp}) must be multiples of "
                f"{elements} (torch._grouped_mm reads 16-byte aligned rows of "
                f"train.precision={run.train.precision})")
    return None


def validate_parallel(run: RunConfig) -> None:
    m, p = run.model, run.parallel
    _choices("parallel", p)
    for name in ("tp", "pp", "ep"):
        _at_least(f"parallel.{name}", getattr(p, name), 1)
    for name in ("dp", "world_size"):
        if getattr(p, name) is not None:
            _at_least(f"parallel.{name}", getattr(p, name), 1)
    _require(m.num_attention_heads % p.tp == 0,
             f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
             f"parallel.tp={p.tp}")
    _require(m.num_query_groups % p.tp == 0,
             f"model.num_query_groups={m.num_query_groups} (KV heads) is not divisible by "
             f"parallel.tp={p.tp}")
    vocab = m.padded_vocab_size
    _require(vocab % p.tp == 0,
             f"padded vocabulary {vocab} (model.vocab_size={m.vocab_size} rounded up to "
             f"model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by}) is not "
             f"divisible by parallel.tp={p.tp}")
    vp = p.vp or 1
    if p.vp is not None:
        _require(p.vp >= 2, f"parallel.vp={p.vp} must be >= 2 (or null for no interleaving)")
        _require(p.pp >= 2, f"parallel.vp={p.vp} needs parallel.pp >= 2 (got {p.pp})")
    _require(m.num_layers % (p.pp * vp) == 0,
             f"model.num_layers={m.num_layers} is not divisible by parallel.pp * parallel.vp "
             f"= {p.pp} * {vp}")
    _require(m.n_loops == 1 or p.pp == 1,
             f"model.n_loops={m.n_loops} (looped transformer, shared weights) needs "
             f"parallel.pp=1 (got {p.pp})")
    if p.ddp_bucket_size is not None:
        _at_least("parallel.ddp_bucket_size", p.ddp_bucket_size, 1)
    if p.overlap_param_gather:
        _require(p.distributed_optimizer, "parallel.overlap_param_gather=true needs "
                 "parallel.distributed_optimizer=true (only its shards are gathered)")
        _require(p.overlap_grad_reduce is not False, "parallel.overlap_param_gather=true "
                 "needs parallel.overlap_grad_reduce (true or null)")
    experts = m.experts
    if experts is None:
        _require(p.ep == 1, f"parallel.ep={p.ep} needs experts to split: model={m.name} has "
                 "none (model.moe.num_experts)")
        _require(p.expert_tp is None, f"parallel.expert_tp={p.expert_tp} needs experts: "
                 f"model={m.name} has none (model.moe.num_experts)")
    else:
        _require(experts.num_experts % p.ep == 0,
                 f"model.moe.num_experts={experts.num_experts} is not divisible by "
                 f"parallel.ep={p.ep}")
        _require(p.tp == 1 or p.sequence_parallel,
                 f"parallel.tp={p.tp} with experts needs parallel.sequence_parallel=true "
                 "(Megatron's MoE layer routes each rank's sequence shard)")
        _require(p.expert_tp in (None, 1, p.tp),
                 f"parallel.expert_tp={p.expert_tp} must be 1 or parallel.tp={p.tp} "
                 "(or null: parallel.tp)")
    if p.sequence_parallel:
        _require(p.tp > 1, "parallel.sequence_parallel=true needs parallel.tp > 1")
        _require(m.seq_length % p.tp == 0,
                 f"model.seq_length={m.seq_length} is not divisible by parallel.tp={p.tp} "
                 "(needed by parallel.sequence_parallel)")


def validate_data(run: RunConfig) -> None:
    d = run.data
    weights = split_weights(d.split)
    _require(weights[0] > 0, f"data.split={d.split!r} leaves no training data (its first "
             "weight, the train share, is 0)")
    _at_least("data.num_workers", d.num_workers, 0)
    if d.prefixes:
        parse_blend(d.prefixes)
        _require(bool(d.tokenizer),
                 "data.tokenizer (a tokenizers JSON file) is required with data.prefixes")
        return
    _require(d.name == "embedded",
             f"data={d.name} has no data.prefixes: give data.prefixes=[path/prefix, ...] "
             "(see depthmix-preprocess), or use data=embedded")
    _at_least("data.embedded_documents", d.embedded_documents, 1)
    _require(d.embedded_vocab_size >= 258,
             f"data.embedded_vocab_size={d.embedded_vocab_size} must be >= 258 "
             "(2 special tokens + 256 byte symbols)")


def validate_train(run: RunConfig) -> None:
    t = run.train
    _choices("train", t)
    for name in ("micro_batch_size", "global_batch_size", "steps", "log_interval",
                 "loss_scale_window"):
        _at_least(f"train.{name}", getattr(t, name), 1)
    for name in ("eval_interval", "eval_iters", "save_interval", "keep_last", "seed"):
        _at_least(f"train.{name}", getattr(t, name), 0)
    for name in ("lr", "adam_eps", "initial_loss_scale", "min_loss_scale"):
        _positive(f"train.{name}", getattr(t, name))
    for name in ("min_lr", "weight_decay", "clip_grad"):
        _at_least(f"train.{name}", getattr(t, name), 0)
    _require(t.min_lr <= t.lr, f"train.min_lr={t.min_lr} must be <= train.lr={t.lr}")
    _require(0.0 <= t.warmup_fraction < 1.0,
             f"train.warmup_fraction={t.warmup_fraction} must be in [0, 1)")
    _require(t.warmup_steps is None or 0 <= t.warmup_steps < t.steps,
             f"train.warmup_steps={t.warmup_steps} must be in [0, train.steps={t.steps})")
    for name in ("adam_beta1", "adam_beta2"):
        _require(0.0 <= getattr(t, name) < 1.0,
                 f"train.{name}={getattr(t, name)} must be in [0, 1)")
    _require(t.min_loss_scale <= t.initial_loss_scale,
             f"train.min_loss_scale={t.min_loss_scale} must be <= train.initial_loss_scale="
             f"{t.initial_loss_scale}")
    if t.exit_after_steps is not None:
        _at_least("train.exit_after_steps", t.exit_after_steps, 1)
    if t.peak_tflops is not None:
        _positive("train.peak_tflops", t.peak_tflops)
    if t.profile_steps is not None:
        steps = list(t.profile_steps)
        _require(len(steps) == 2 and 1 <= steps[0] <= steps[1],
                 f"train.profile_steps={steps} must be [first, last] with 1 <= first <= last")
    # divergence policies and checkpoint integrity (depthmix.pretrain.health)
    _at_least("train.max_nonfinite_steps", t.max_nonfinite_steps, 1)
    if t.spike_zscore is not None:
        _positive("train.spike_zscore", t.spike_zscore)
    _at_least("train.spike_window", t.spike_window, 2)
    # the fast path (docs/operations.md); a GPU's presence is preflight's check
    _require(not t.cuda_graphs or t.compile != "false",
             "train.cuda_graphs=true needs train.compile=true (it graphs the compiled layers)")


def validate_logger(run: RunConfig) -> None:
    lg = run.logger
    _choices("logger", lg)
    _at_least("logger.depth_stats_interval", lg.depth_stats_interval, 0)


def data_parallel_size(run: RunConfig, world_size: int) -> int:
    p = run.parallel
    model_parallel = p.tp * p.pp
    _require(
        world_size % model_parallel == 0,
        f"world size {world_size} is not divisible by parallel.tp * parallel.pp = "
        f"{p.tp} * {p.pp}",
    )
    dp = world_size // model_parallel
    _require(
        p.dp is None or p.dp == dp,
        f"world size {world_size} != parallel.tp * parallel.pp * parallel.dp = "
        f"{p.tp} * {p.pp} * {p.dp}",
    )
    return dp


def expert_tp_size(parallel) -> int:
    """``parallel.expert_tp``, None meaning ``parallel.tp``."""
    return parallel.tp if parallel.expert_tp is None else parallel.expert_tp


def expert_data_parallel_size(run: RunConfig, world_size: int) -> int:
    """The experts' data-parallel size. Megatron-Core lays the experts out on a grid of
    their own over the ranks of each pipeline stage: world = pp x expert_tp x ep x edp,
    beside the dense world = pp x tp x dp (``initialize_model_parallel``)."""
    p = run.parallel
    etp = expert_tp_size(p)
    grid = etp * p.ep * p.pp
    _require(world_size % grid == 0,
             f"parallel.ep={p.ep} does not fit world size {world_size}: parallel.ep * "
             f"parallel.expert_tp * parallel.pp = {p.ep} * {etp} * {p.pp} must divide it")
    return world_size // grid


def validate_layout(run: RunConfig, world_size: int) -> None:
    """The checks that need the number of processes."""
    p, t = run.parallel, run.train
    _require(world_size >= 1, f"world size {world_size} must be >= 1 (parallel.world_size)")
    _require(p.world_size is None or p.world_size == world_size,
             f"parallel.world_size={p.world_size} but this job has {world_size} processes "
             "(torchrun --nnodes x --nproc-per-node, or srun tasks)")
    dp = data_parallel_size(run, world_size)
    if run.model.experts is not None:
        expert_data_parallel_size(run, world_size)
    _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
             f"train.global_batch_size={t.global_batch_size} is not divisible by "
             f"train.micro_batch_size * data-parallel size = {t.micro_batch_size} * {dp}")
    num_micro = t.global_batch_size // (t.micro_batch_size * dp)
    if p.pp > 1 and p.vp is not None:
        _require(num_micro % p.pp == 0,
                 f"interleaved pipelining needs the number of micro-batches ({num_micro} = "
                 f"train.global_batch_size / (train.micro_batch_size * dp)) to be a "
                 f"multiple of parallel.pp={p.pp}")


def validate(run: RunConfig, world_size: Optional[int] = None) -> None:
    """Raise :class:`ConfigError` naming the option for any configuration that cannot run."""
    validate_model(run)
    validate_parallel(run)
    validate_data(run)
    validate_train(run)
    validate_logger(run)
    if world_size is not None:
        validate_layout(run, world_size)
    if run.mixer is not None:
        run.mixer.validate(run.model, run.parallel)
