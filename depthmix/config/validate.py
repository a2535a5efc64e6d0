"""Start-up checks: every impossible configuration fails here, before any model is built."""

from __future__ import annotations

from typing import Optional

from depthmix.config.schema import ConfigError, RunConfig

PRECISIONS = ("fp32", "bf16", "fp16")
NONFINITE_POLICIES = ("skip", "stop", "rollback")
SPIKE_POLICIES = ("log", "skip", "rollback")
CKPT_INTEGRITY = ("checksum", "size", "off")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


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


def _validate_health(t) -> None:
    """Divergence policies and checkpoint integrity (``depthmix.pretrain.health``)."""
    _require(t.on_nonfinite in NONFINITE_POLICIES,
             f"train.on_nonfinite={t.on_nonfinite!r} must be one of {NONFINITE_POLICIES}")
    _require(t.on_spike in SPIKE_POLICIES,
             f"train.on_spike={t.on_spike!r} must be one of {SPIKE_POLICIES}")
    _require(t.max_nonfinite_steps >= 1,
             f"train.max_nonfinite_steps={t.max_nonfinite_steps} must be >= 1")
    _require(t.spike_zscore is None or t.spike_zscore > 0,
             f"train.spike_zscore={t.spike_zscore} must be > 0 (or null: no spike detection)")
    _require(t.spike_window >= 2, f"train.spike_window={t.spike_window} must be >= 2")
    _require(t.ckpt_integrity in CKPT_INTEGRITY,
             f"train.ckpt_integrity={t.ckpt_integrity!r} must be one of {CKPT_INTEGRITY}")


def validate(run: RunConfig, world_size: Optional[int] = None) -> None:
    """Raise :class:`ConfigError` naming the option for any configuration that cannot run."""
    m, p, t, d = run.model, run.parallel, run.train, run.data
    for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "vocab_size", "seq_length", "n_loops"):
        _require(getattr(m, name) >= 1, f"model.{name}={getattr(m, name)} must be >= 1")
    _require(m.num_attention_heads % m.num_query_groups == 0,
             f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
             f"model.num_query_groups={m.num_query_groups}")
    if m.head_dim is None:
        _require(m.hidden_size % m.num_attention_heads == 0,
                 f"model.hidden_size={m.hidden_size} is not divisible by "
                 f"model.num_attention_heads={m.num_attention_heads}; set model.head_dim")
    _require(m.norm_position in ("pre", "post"),
             f"model.norm_position={m.norm_position!r} must be 'pre' or 'post'")

    for name in ("tp", "pp"):
        _require(getattr(p, name) >= 1, f"parallel.{name}={getattr(p, name)} must be >= 1")
    _require(m.num_attention_heads % p.tp == 0,
             f"model.num_attention_heads={m.num_attention_heads} is not divisible by "
             f"parallel.tp={p.tp}")
    _require(m.num_query_groups % p.tp == 0,
             f"model.num_query_groups={m.num_query_groups} (KV heads) is not divisible by "
             f"parallel.tp={p.tp}")
    from depthmix.config.megatron import padded_vocab_size

    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
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
    if p.sequence_parallel:
        _require(p.tp > 1, "parallel.sequence_parallel=true needs parallel.tp > 1")
        _require(m.seq_length % p.tp == 0,
                 f"model.seq_length={m.seq_length} is not divisible by parallel.tp={p.tp} "
                 "(needed by parallel.sequence_parallel)")
    _require(p.recompute in ("none", "full"),
             f"parallel.recompute={p.recompute!r} must be 'none' or 'full'")

    _require(t.precision in PRECISIONS,
             f"train.precision={t.precision!r} must be one of {PRECISIONS}")
    _require(t.micro_batch_size >= 1, f"train.micro_batch_size={t.micro_batch_size} must be >= 1")
    _require(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _require(0.0 <= t.warmup_fraction < 1.0,
             f"train.warmup_fraction={t.warmup_fraction} must be in [0, 1)")
    _require(t.warmup_steps is None or 0 <= t.warmup_steps < t.steps,
             f"train.warmup_steps={t.warmup_steps} must be in [0, train.steps={t.steps})")
    _validate_health(t)
    if world_size is not None:
        dp = data_parallel_size(run, world_size)
        _require(t.global_batch_size % (t.micro_batch_size * dp) == 0,
                 f"train.global_batch_size={t.global_batch_size} is not divisible by "
                 f"train.micro_batch_size * data-parallel size = {t.micro_batch_size} * {dp}")
        num_micro = t.global_batch_size // (t.micro_batch_size * dp)
        if p.pp > 1 and p.vp is not None:
            _require(num_micro % p.pp == 0,
                     f"interleaved pipelining needs the number of micro-batches ({num_micro} = "
                     f"train.global_batch_size / (train.micro_batch_size * dp)) to be a "
                     f"multiple of parallel.pp={p.pp}")

    if d.prefixes:
        _require(d.tokenizer is not None,
                 "data.tokenizer (a tokenizers JSON file) is required with data.prefixes")
        import os

        from depthmix.data.integrity import check_prefix

        for i, item in enumerate(d.prefixes):
            if isinstance(item, (int, float)):
                continue
            check_prefix(os.path.expanduser(str(item)), f"data.prefixes[{i}]", deep=False)
        _require(os.path.exists(d.tokenizer), f"data.tokenizer={d.tokenizer} not found")
    else:
        _require(d.name == "embedded",
                 f"data={d.name} has no data.prefixes: give data.prefixes=[path/prefix, ...] "
                 "(see depthmix-preprocess), or use data=embedded")

    if run.mixer is not None:
        run.mixer.validate(m, p)
