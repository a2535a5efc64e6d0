"""Megatron distributed checkpoints: what goes into one, save (write, then publish) and load
(also into another layout).

The files and the save directory's layout are :mod:`depthmix.checkpoint.store`'s; which
checkpoint a run resumes or rolls back to, :mod:`.resume`'s; what is kept,
:mod:`.retention`'s; the lock, room and clean failure, :mod:`.guard`'s.

**Contents.** Model chunks (``model`` or ``model0``, ``model1``, ... with virtual stages;
tensor keys use global layer indices, so any TP/PP layout can load them), the optimizer
(Adam moments, fp32 main params, the fp16 loss scaler; distributed-optimizer state in the
``train.ckpt_optim_format`` layout), the LR scheduler, ``step`` and
``consumed_train_samples`` (the data position), and every rank's RNG states (Python, NumPy,
torch, CUDA and Megatron's model-parallel tracker), restored only when the layout is
unchanged. Expert weights carry their global expert index (Megatron's ``SequentialMLP``
sharded state dict), so a checkpoint moves between expert-parallel sizes as between TP/PP
layouts; the experts' optimizer is the second of Megatron's chained optimizers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.api import CheckpointException

from depthmix.checkpoint import guard, integrity, retention, store
from depthmix.checkpoint.record import mismatches, record
from depthmix.config.schema import ConfigError

log = logging.getLogger("depthmix")


# ---------------------------------------------------------------------------------------
# What goes into a checkpoint
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    vp: int
    dp: int
    distributed_optimizer: bool
    ep: int = 1
    expert_tp: Optional[int] = None
    """None (a checkpoint from before expert parallelism): ``tp``."""

    def __post_init__(self):
        if self.expert_tp is None:
            object.__setattr__(self, "expert_tp", self.tp)

    @classmethod
    def of(cls, topo, run) -> "Layout":
        return cls(topo.tp, topo.pp, topo.vp, topo.dp, run.parallel.distributed_optimizer,
                   topo.ep, topo.expert_tp)

    def model_parallel(self) -> tuple:
        return self.tp, self.pp, self.vp, self.ep, self.expert_tp


def rng_state() -> dict:
    """Every random generator this rank uses. On CPU, "CUDA" is the CPU generator."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(topo, state) -> ShardedObject:
    """One object per rank, addressed by its (pp, tp, dp) coordinates."""
    return ShardedObject("rng_state", state, (topo.pp, topo.tp, topo.dp),
                         (topo.pp_rank, topo.tp_rank, topo.dp_rank), replica_id=0)


def _distributed_optimizers(optimizer) -> list:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [o for o in inner if isinstance(o, DistributedOptimizer)]


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _inner(chunk):
    """The module whose state dict a checkpoint holds: under Megatron's DDP wrapper (which
    training adds), else the chunk itself (lean loading: bare or ``Float16Module``)."""
    from megatron.core.distributed import DistributedDataParallel

    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def _weights_module(chunk):
    """``_inner(chunk)`` without ``Float16Module``, whose ``load_state_dict`` forwards to its
    module but returns nothing (the missing keys are needed to log what kept its init)."""
    from megatron.core.transformer.module import Float16Module

    inner = _inner(chunk)
    return inner.module if isinstance(inner, Float16Module) else inner


def sharded_state_dict(model, optimizer, scheduler, topo, position: tuple, is_loading: bool,
                       rng: bool = True, optim_format: str = "dp_reshardable") -> dict:
    """Model chunks, optimizer and scheduler (when ``optimizer`` is given), RNG states and
    the data ``position`` (step, consumed samples) as Megatron sharded tensors/objects."""
    state = {}
    for i, chunk in enumerate(model):
        state[_model_key(i, len(model))] = _inner(chunk).sharded_state_dict()
    if optimizer is not None:
        # with experts the optimizer is a chain (dense, experts); its keys take no chain
        # prefix where they are model-space keys (the plain optimizer's, fully_reshardable),
        # so the experts' state moves between expert-parallel sizes by global expert index
        metadata = {"chained_optim_avoid_prefix": True}
        if _distributed_optimizers(optimizer):
            metadata["distrib_optim_sharding_type"] = optim_format
        if is_loading:
            # the distributed optimizer's state tensors must exist to be loaded into
            for opt in _distributed_optimizers(optimizer):
                opt._init_optimizer_states_with_dummy_values()
        state["optimizer"] = optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata=metadata)
        state["scheduler"] = scheduler.state_dict()
    if rng:
        state["rng_state"] = _rng_sharded_object(topo, None if is_loading else rng_state())
    step, consumed = position
    state["trainer"] = {"step": step, "consumed_train_samples": consumed}
    return state


def _save_strategy(fully_parallel: bool):
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelSaveStrategyWrapper,
    )

    strategy = get_default_save_sharded_strategy()
    if fully_parallel and parallel_state.get_data_parallel_world_size() > 1:
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    return strategy


def _load_strategy(path: str, fully_parallel: bool):
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import (
        FullyParallelLoadStrategyWrapper,
    )

    strategy = get_default_load_sharded_strategy(path)
    if fully_parallel and parallel_state.get_data_parallel_world_size() > 1:
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    return strategy


# ---------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------


@dataclass
class Written:
    """A checkpoint whose shards are being (or have been) written into its temporary
    directory; :func:`publish` makes it visible. ``request``: the background write that
    :class:`~depthmix.checkpoint.background.BackgroundSaves` runs (None when written)."""

    root: str
    step: int
    meta: dict
    tokenizer: Optional[str]
    integrity: str
    keep_last: int
    estimate: Optional[int]
    started: float
    request: object = None


def save(root: str, *, run, model, optimizer, scheduler, topo, step: int,
         consumed_samples: int, keep_last: int = 2, estimate: Optional[int] = None,
         health: Optional[dict] = None, tokenizer: Optional[str] = None,
         extra_meta: Optional[dict] = None) -> str:
    """Collective: write the checkpoint of ``step`` (data position ``consumed_samples``),
    publish it and prune the save directory. Returns its path.

    ``estimate``: the expected size in bytes (room is made for it before writing);
    ``health``: the health record (:meth:`HealthGuard.mark`, default healthy);
    ``tokenizer``: the run's tokenizer file, copied in."""
    written = write(root, run=run, model=model, optimizer=optimizer, scheduler=scheduler,
                    topo=topo, step=step, consumed_samples=consumed_samples,
                    keep_last=keep_last, estimate=estimate, health=health,
                    tokenizer=tokenizer, extra_meta=extra_meta)
    with guard.failing(root, step, estimate):
        final = publish(written)
    log.info("saved checkpoint %s in %.2f s", final, time.perf_counter() - written.started)
    return final


def write(root: str, *, run, model, optimizer, scheduler, topo, step: int,
          consumed_samples: int, keep_last: int = 2, estimate: Optional[int] = None,
          health: Optional[dict] = None, tokenizer: Optional[str] = None,
          extra_meta: Optional[dict] = None, background: bool = False) -> Written:
    """Collective: room is made (:func:`guard.prepare`), then every rank writes its shards of
    ``step`` into the temporary directory; with ``background`` only the write's plan is
    made and :attr:`Written.request` holds the write itself (Megatron's asynchronous save)."""
    t = run.train
    health = health if health is not None else {"healthy": True}
    started = time.perf_counter()
    guard.prepare(root, step, keep_last=keep_last, estimate=estimate, health=health)
    written = Written(root, step, {
        "format_version": store.FORMAT_VERSION,
        "step": step,
        "consumed_train_samples": consumed_samples,
        "layout": Layout.of(topo, run).__dict__,
        "optim_format": t.ckpt_optim_format,
        "world_size": dist.get_world_size(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "record": record(run),
        "health": health,
        "integrity": t.ckpt_integrity,
        **(extra_meta or {}),
    }, tokenizer, t.ckpt_integrity, keep_last, estimate, started)
    with guard.failing(root, step, estimate):
        tmp = store.tmp_dir(root, step)
        if dist.get_rank() == 0:
            os.makedirs(tmp)
        dist.barrier()
        sharded = sharded_state_dict(model, optimizer, scheduler, topo, (step, consumed_samples),
                                     is_loading=False, optim_format=t.ckpt_optim_format)
        written.request = dist_checkpointing.save(
            sharded, tmp, sharded_strategy=_save_strategy(t.ckpt_fully_parallel),
            async_sharded_save=background)
    return written


def publish(written: Written) -> str:
    """Collective, once every rank's shards are written: checksums, ``depthmix.json``, the
    rename to ``iter_*`` and the tracker (:func:`store.publish`), retention. Returns the
    checkpoint's path."""
    root, step, rank = written.root, written.step, dist.get_rank()
    tmp = store.tmp_dir(root, step)
    dist.barrier()
    if rank == 0:
        store.copy_tokenizer(tmp, written.tokenizer)
    files = integrity.manifest(tmp, written.integrity, exclude=(store.META,))  # collective
    if rank == 0:
        store.write_meta(tmp, {**written.meta, "files": files})
        store.publish(root, step)
        retention.prune(root, written.keep_last, step)
    dist.barrier()
    return store.step_dir(root, step)


# ---------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------


@dataclass
class Loaded:
    """What :func:`load` restored: the checkpoint's metadata, and its data position (step,
    consumed samples) unless only weights were loaded."""

    path: str
    meta: dict
    weights_only: bool
    step: Optional[int] = None
    consumed_samples: Optional[int] = None


def load(path: str, *, run, model, topo, optimizer=None, scheduler=None,
         weights_only: bool = False) -> Loaded:
    """Collective: load the checkpoint directory ``path`` into ``model`` (and ``optimizer``,
    ``scheduler``).

    Weights always; optimizer, scheduler and data position unless ``weights_only`` (or no
    optimizer: evaluation); RNG states only when the (TP, PP, VP, DP) layout is the one the
    checkpoint was saved with.
    """
    t = run.train
    meta = store.read_meta(path)
    load_optimizer = not weights_only and optimizer is not None
    saved = Layout(**meta["layout"])
    now = Layout.of(topo, run)
    same_layout = saved == now
    optim_format = meta.get("optim_format", "dp_reshardable")
    if load_optimizer and saved.distributed_optimizer != now.distributed_optimizer:
        raise ConfigError(
            f"checkpoint {path} was saved with parallel.distributed_optimizer="
            f"{saved.distributed_optimizer}; resuming with {now.distributed_optimizer} needs "
            "train.load_weights_only=true")
    if (load_optimizer and now.distributed_optimizer and optim_format == "dp_reshardable"
            and saved.model_parallel() != now.model_parallel()):
        raise ConfigError(
            f"checkpoint {path} holds distributed-optimizer state in the dp_reshardable format, "
            f"which cannot move from tp/pp/vp/ep/expert_tp={saved.model_parallel()} to "
            f"{now.model_parallel()}: save it with train.ckpt_optim_format=fully_reshardable, "
            "or load weights only with train.load_weights_only=true")

    start = time.perf_counter()
    sharded = sharded_state_dict(model, optimizer if load_optimizer else None, scheduler, topo,
                                 (0, 0), is_loading=True, rng=same_layout and load_optimizer,
                                 optim_format=optim_format)
    new_mixer = not load_optimizer and _only_the_mixer_differs(meta, run)
    with torch.no_grad():
        strategy = _load_strategy(path, t.ckpt_fully_parallel)
        try:
            if new_mixer:  # the new mixer's own parameters are not in the checkpoint
                loaded, _, _ = dist_checkpointing.load(
                    sharded, path, sharded_strategy=strategy,
                    strict=StrictHandling.RETURN_UNEXPECTED)
            else:
                loaded = dist_checkpointing.load(sharded, path, sharded_strategy=strategy)
            kept = []
            for i, chunk in enumerate(model):
                result = _weights_module(chunk).load_state_dict(
                    loaded[_model_key(i, len(model))], strict=not new_mixer)
                kept += result.missing_keys if new_mixer else []
        except (KeyError, RuntimeError, CheckpointingException, CheckpointException) as e:
            raise _weights_do_not_fit(path, meta, run, e) from e
        if kept:
            log.info("loaded the weights of %s (mixer=%s): %d tensors it does not have keep "
                     "their initialisation (%s%s)", path, meta["record"]["mixer"]["name"],
                     len(kept), ", ".join(kept[:3]), ", ..." if len(kept) > 3 else "")
        if load_optimizer:
            # each param group carries its own peak/floor LR, which the scheduler prefers
            # to its own: keep the config's (else a resume with a new train.lr ignores it)
            lrs = [(g.get("max_lr"), g.get("min_lr")) for g in optimizer.param_groups]
            with _keep_adam_steps(optimizer, optim_format):
                optimizer.load_state_dict(loaded["optimizer"])
            _restore_adam_steps(optimizer)
            for group, (max_lr, min_lr) in zip(optimizer.param_groups, lrs):
                if max_lr is not None:
                    group["max_lr"], group["min_lr"] = max_lr, min_lr
        elif optimizer is not None:
            optimizer.reload_model_params()
    result = Loaded(path, meta, weights_only=not load_optimizer)
    if load_optimizer:
        _load_scheduler(scheduler, loaded["scheduler"])
        result.step = int(loaded["trainer"]["step"])
        result.consumed_samples = int(loaded["trainer"]["consumed_train_samples"])
        if same_layout:
            set_rng_state(loaded["rng_state"])
        else:
            log.warning("layout changed from %s to %s: RNG states not restored (each rank "
                        "keeps its seeded generators)", saved, now)
    dist.barrier()
    log.info("loaded checkpoint %s (step %d%s) in %.2f s", path, meta["step"],
             "" if load_optimizer else ", weights only", time.perf_counter() - start)
    return result


def load_whole_model(path: str, model) -> None:
    """The weights of the checkpoint ``path``, saved at any layout, into one whole
    ``DepthMixModel`` (a single rank): Megatron reshards them by their global keys."""
    with torch.no_grad():
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(loaded["model"], strict=True)


WEIGHT_SET_OPTIONS = ("model.num_layers", "model.qk_layernorm", "model.tie_embeddings")
"""Model options that decide which weights (not only their shapes) the model has."""


def _only_the_mixer_differs(meta: dict, run) -> bool:
    """The checkpoint was saved with other mixer options (another mixer, ShortSWA, ...) and
    the same set of model weights: a weights-only load may then leave the parameters only
    this mixer has at their initialisation (any other absent weight is an error)."""
    if "record" not in meta:
        return False
    diffs = mismatches(meta["record"], run)
    return (any(line.startswith("mixer.") for line in diffs)
            and not any(line.startswith(WEIGHT_SET_OPTIONS) for line in diffs))


def _weights_do_not_fit(path: str, meta: dict, run, error: BaseException) -> ConfigError:
    diffs = mismatches(meta["record"], run) if "record" in meta else []
    first = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
    return ConfigError(
        f"the weights of {path} do not fit this model ("
        + ("differing options: " + "; ".join(diffs) if diffs else
           "no recorded model option differs") + f"): {first}")


@contextlib.contextmanager
def _keep_adam_steps(optimizer, optim_format: str):
    """Work around Megatron 0.16.1's fully_reshardable loader with torch's Adam (no
    TE/Apex): it copies every per-param state entry, ``step`` included, from checkpoint
    tensors that never contain ``step`` (KeyError 'step'). While loading, hand it each
    param's current ``step`` (already set from the param groups) to copy onto itself."""
    patched = []
    if optim_format == "fully_reshardable":
        for opt in _distributed_optimizers(optimizer):
            original = opt._set_main_param_and_optimizer_states

            def with_step(model_param, tensors, opt=opt, original=original):
                if "step" not in tensors:
                    group, order = opt.model_param_group_index_map[model_param]
                    main = opt.optimizer.param_groups[group]["params"][order]
                    step = opt.optimizer.state.get(main, {}).get("step")
                    if step is not None:
                        tensors = {**tensors, "step": step}
                return original(model_param, tensors)

            opt._set_main_param_and_optimizer_states = with_step
            patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def _restore_adam_steps(optimizer) -> None:
    """Distributed optimizer with torch's Adam: the loaded per-group ``step`` must reach
    each param's state, or Adam's bias correction restarts from step 1."""
    for opt in _distributed_optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            if group.get("step") is None:
                continue
            for p in group["params"]:
                st = opt.optimizer.state.get(p)
                if st is None or "exp_avg" not in st:
                    continue
                old = st.get("step")
                st["step"] = (torch.full_like(old, float(group["step"])) if torch.is_tensor(old)
                              else torch.tensor(float(group["step"]), dtype=torch.float32))


def _load_scheduler(scheduler, saved: dict) -> None:
    """The schedule's *position* comes from the checkpoint; its shape (peak LR, warmup,
    decay steps) from the current config, with a warning for every difference."""
    current = scheduler.state_dict()
    changed = {k: (saved[k], v) for k, v in current.items()
               if k != "num_steps" and k in saved and saved[k] != v}
    if changed:
        log.warning("LR schedule differs from the checkpoint's; using the config's: %s",
                    ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items()))
    scheduler.override_opt_param_scheduler = True
    scheduler.num_steps = 0  # load_state_dict *adds* the saved position (a rollback reloads)
    try:
        scheduler.load_state_dict(saved)
    finally:
        scheduler.override_opt_param_scheduler = False
