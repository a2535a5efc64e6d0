"""Helpers for tests and benchmarks: tiny configs, an in-process single-rank Megatron and
runs in spawned rank processes. The ones that build (:func:`init_single_process`,
:func:`build_model`, :func:`train_and_save`) install :mod:`depthmix.runtime` when nothing
has (:func:`depthmix.runtime.entry_point`; the test harness, ``tests/conftest.py``, holds it
for the session; :func:`spawn`'s ranks install it themselves)."""

from __future__ import annotations

import os
from typing import Optional

import torch

from depthmix import runtime
from depthmix.config.schema import RunConfig
from depthmix.runtime.env import free_port


@runtime.entry_point
def init_single_process(seed: int = 1234) -> None:
    """World size 1 with gloo and Megatron's parallel state at TP=PP=1 (idempotent)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(seed)


def tiny_run(mixer: str = "vanilla", **mixer_options) -> RunConfig:
    """A 4-layer, 64-wide GQA (G=2) model on 16-token sequences; fp32."""
    from depthmix.mixers import get_mixer

    run = RunConfig()
    m = run.model
    m.num_layers, m.hidden_size, m.ffn_hidden_size = 4, 64, 160
    m.num_attention_heads, m.num_query_groups = 4, 2
    m.vocab_size, m.make_vocab_size_divisible_by, m.seq_length = 128, 64, 16
    from depthmix.kernels.dispatch import resolve_impl

    run.mixer = get_mixer(mixer).config_cls(name=mixer, **mixer_options)
    run.mixer.resolve(run.model)
    run.mixer.impl, _ = resolve_impl(run.mixer.impl)
    run.train.precision = "fp32"
    return run


def variant_cases(check: str) -> list:
    """``(test id, mixer, Variant)`` for every variant of every registered mixer that runs
    in ``check`` (:data:`depthmix.mixers.base.CHECKS`); ``kernels``: mixers with kernels."""
    from depthmix.mixers import available, get_mixer

    out = []
    for name in available():
        mixer = get_mixer(name)
        if check != "kernels" or mixer.kernels:
            out += [(v.id_for(name), name, v) for v in mixer.variants if check in v.checks]
    return out


def variant_run(mixer: str, variant) -> RunConfig:
    """:func:`tiny_run` at a :class:`~depthmix.mixers.base.Variant`: its mixer options, then
    its model fields."""
    run = tiny_run(mixer, **variant.options)
    for key, value in variant.model.items():
        setattr(run.model, key, value)
    return run


@runtime.entry_point
def build_model(run: RunConfig, dtype: Optional[torch.dtype] = None):
    """Build the whole model on one rank (call :func:`init_single_process` first)."""
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.config.validate import validate
    from depthmix.megatron_ext.model import build_chunk
    from depthmix.mixers import mixer_of

    validate(run)
    model = build_chunk(to_transformer_config(run), mixer_of(run))
    return model.to(dtype) if dtype is not None else model


def assert_kernel_model_equals_torch(make_run, perturb: tuple) -> None:
    """``make_run(impl)`` built in fp64 for ``impl`` torch and triton, the parameters whose
    names end in ``perturb`` moved away from their init by the same draws: the logits and
    every parameter's gradient of a random projection of them agree within 1e-10."""
    results = []
    for impl in ("torch", "triton"):
        run = make_run(impl)
        assert run.mixer.impl == impl
        model = build_model(run, dtype=torch.float64)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(perturb):
                    p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
        ids = torch.randint(0, run.model.vocab_size, (2, run.model.seq_length), generator=g)
        logits = model(ids)
        w = torch.randn(logits.shape, generator=g, dtype=logits.dtype)
        names, params = zip(*model.named_parameters())
        grads = torch.autograd.grad((logits * w).sum(), params)
        results.append((logits, dict(zip(names, grads))))
    (ref_logits, ref_grads), (logits, grads) = results
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-12)
    for name, g_ref in ref_grads.items():
        torch.testing.assert_close(grads[name], g_ref, rtol=1e-10, atol=1e-12 * (
            1 + g_ref.abs().max().item()), msg=lambda m, n=name: f"{n}: {m}")


@runtime.entry_point
@torch.no_grad()
def train_and_save(run: RunConfig, root: str, tokenizer: str) -> str:
    """One step of ``run``, then a checkpoint in ``root`` carrying the ``tokenizer`` file;
    returns its directory. Collective."""
    from depthmix.data.tokenizer import HFTokenizer
    from depthmix.pretrain.parallelize import destroy_model_parallel
    from depthmix.pretrain.trainer import Trainer

    run.train.save_dir, run.output_dir = root, os.path.dirname(root)
    with torch.enable_grad():  # a caller under no_grad (the lm-eval tests) still trains
        trainer = Trainer(run, data=SyntheticData, callbacks=[])
        trainer.train_one_step()
    trainer.data.tokenizer = HFTokenizer(tokenizer)  # saved beside the weights
    path = trainer.save_checkpoint(root)
    del trainer
    destroy_model_parallel()
    return path


def incremental_logits(model, input_ids: torch.Tensor, prefill: int = 1) -> torch.Tensor:
    """Logits ``[b, s, v]`` from a prefill of ``prefill`` tokens then one token at a time
    through the KV cache; must equal ``model(input_ids)``."""
    from depthmix.inference import KVCache

    cache = KVCache()
    outs = [model(input_ids[:, :prefill], inference=cache)]
    cache.advance(prefill)
    for t in range(prefill, input_ids.shape[1]):
        outs.append(model(input_ids[:, t : t + 1], inference=cache))
        cache.advance(1)
    return torch.cat(outs, dim=1)


# ---------------------------------------------------------------------------------------
# Synthetic data and multi-process runs (parity tests, benchmarks)
# ---------------------------------------------------------------------------------------


def synthetic_sample(seed: int, index: int, seq_length: int, vocab_size: int):
    """Global sample ``index``: a token sequence that depends only on (seed, index)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + index)
    x = torch.randint(0, vocab_size, (seq_length + 1,), generator=g)
    return x[:-1], x[1:]


class SyntheticData:
    """Random-token micro-batches with Megatron's sampling order: every global batch is
    cut into micro-batches of ``micro_batch_size * dp`` samples, rank ``r`` taking the
    ``r``-th slice of each, so every DP size sees the same samples per step."""

    def __init__(self, run: RunConfig, dp_rank: int = 0, dp_size: int = 1, consumed: int = 0,
                 vocab_size: Optional[int] = None):
        self.run, self.dp_rank, self.dp_size = run, dp_rank, dp_size
        self.vocab = vocab_size or run.model.vocab_size
        self.train_iterator = self._batches(consumed, run.train.seed)

    def _batches(self, start: int, seed: int):
        t, s = self.run.train, self.run.model.seq_length
        i = start
        while True:
            first = i + self.dp_rank * t.micro_batch_size
            pairs = [synthetic_sample(seed, first + j, s, self.vocab)
                     for j in range(t.micro_batch_size)]
            tokens = torch.stack([p[0] for p in pairs])
            labels = torch.stack([p[1] for p in pairs])
            yield {
                "tokens": tokens,
                "labels": labels,
                "loss_mask": torch.ones_like(tokens, dtype=torch.float32),
                "position_ids": torch.arange(s).unsqueeze(0).expand_as(tokens).clone(),
            }
            i += t.micro_batch_size * self.dp_size

    def valid_iterator(self):
        return self._batches(0, self.run.train.seed + 1)


def global_param_name(chunk, name: str) -> str:
    """``decoder.layers.<local>.x`` -> ``decoder.layers.<global>.x`` for a model chunk."""
    prefix = "decoder.layers."
    if name.startswith(prefix):
        local, rest = name[len(prefix):].split(".", 1)
        return f"{prefix}{chunk.decoder.layer_indices.start + int(local)}.{rest}"
    return name


def global_expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """``...local_experts.<local>.x`` -> ``...local_experts.<global>.x`` on expert-parallel
    rank ``ep_rank`` (it holds experts ``[ep_rank * num_local, (ep_rank + 1) * num_local)``)."""
    import re

    return re.sub(r"local_experts\.(\d+)\.",
                  lambda m: f"local_experts.{ep_rank * num_local + int(m.group(1))}.", name)


def gather_full(model, which: str = "grad") -> dict:
    """Full (TP-gathered, all-stage, all-expert) parameters or main grads by global name, in
    the single-rank layout; collective, every rank gets the dict. Expert weights (Megatron
    marks them ``allreduce=False``) gather over the expert-TP group and take their global
    expert index. For tests and small models only."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from depthmix.megatron_ext.model import unwrap

    groups = {False: (ps.get_tensor_model_parallel_group(),
                      ps.get_tensor_model_parallel_world_size()),
              True: (ps.get_expert_tensor_parallel_group(),
                     ps.get_expert_tensor_parallel_world_size())}
    ep, ep_rank = ps.get_expert_model_parallel_world_size(), ps.get_expert_model_parallel_rank()
    # one copy of each: dense weights from TP and DP rank 0, experts from expert-TP and
    # expert-DP rank 0 of every expert-parallel rank
    keep = {False: ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0,
            True: (ps.get_expert_tensor_parallel_rank() == 0
                   and ps.get_expert_data_parallel_rank() == 0)}
    local = {}
    for wrapped in model:
        chunk = unwrap(wrapped)
        for name, param in chunk.named_parameters():
            expert = not getattr(param, "allreduce", True)
            group, size = groups[expert]
            t = param.main_grad if which == "grad" else param.data
            t = t.detach().float().clone()
            if size > 1 and getattr(param, "tensor_model_parallel", False):
                parts = [torch.empty_like(t) for _ in range(size)]
                dist.all_gather(parts, t.contiguous(), group=group)
                # a shard holds `stride` interleaved pieces (e.g. SwiGLU's gate and up)
                stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
                pieces = [p.chunk(stride, dim=dim) for p in parts]
                t = torch.cat([pieces[r][i] for i in range(stride) for r in range(size)],
                              dim=dim)
            name = global_param_name(chunk, name)
            if expert:
                name = global_expert_name(name, ep_rank, chunk.config.num_moe_experts // ep)
            if keep[expert]:
                local[name] = t
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    merged = {}
    for part in everything:
        merged.update(part)
    return merged


def spawn(target, world_size: int, args=(), timeout: float = 600.0, env=None) -> list:
    """Run ``target(*args)`` in ``world_size`` new processes with the torch.distributed
    environment set (gloo on CPU); returns each rank's return value. Fails on a timeout or
    on any rank's crash. ``target`` must be importable (a module-level function). The ranks
    fork from a forkserver that preloads torch and Megatron-Core (they see the environment
    it started with, plus ``env``); ``DEPTHMIX_MP_START=spawn`` starts each from scratch."""
    import multiprocessing as mp
    import tempfile
    import time

    ctx = mp.get_context(os.environ.get("DEPTHMIX_MP_START", "forkserver"))
    if ctx.get_start_method() == "forkserver":
        # ranks fork from one server per process that has imported torch and Megatron-Core
        # once (~3 CPU-s a rank otherwise); the server starts from this process's
        # environment and imports nothing that changes global state
        ctx.set_forkserver_preload(["depthmix.testing", "depthmix.pretrain.trainer"])
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_rank_entry,
                             args=(r, world_size, port, env or {}, target, args, out))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
            if any(p.is_alive() for p in procs):
                raise TimeoutError(f"rank processes still running after {timeout:.0f}s")
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
        codes = [p.exitcode for p in procs]
        if any(codes):
            raise RuntimeError(f"rank processes failed with exit codes {codes}")
        return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False)
                for r in range(world_size)]


def _rank_entry(rank, world_size, port, env, target, args, out_dir) -> None:
    # a fresh process: its environment is what a launcher (torchrun) would give a rank
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      **env)
    torch.set_num_threads(1)
    from depthmix.pretrain.parallelize import destroy_distributed

    with runtime.installed(hold_warnings=False):
        result = target(*args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        destroy_distributed()


def _train_runs(runs: list, steps: int, mode: str) -> list:
    """One rank of :func:`run_layouts`: the runs one after the other in this process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from depthmix.megatron_ext.model import unwrap
    from depthmix.pretrain.parallelize import destroy_model_parallel
    from depthmix.pretrain.trainer import Trainer

    results = []
    for run in runs:
        trainer = Trainer(run, data=_DataForRank(run), callbacks=[])
        result = {"losses": [], "grad_norms": [], "experts": None}
        if mode == "parity":
            result["init_params"] = gather_full(trainer.model, "param")
        for step in range(steps):
            hook = None
            if step == 0 and mode == "parity":
                def hook(model):
                    result["grads"] = gather_full(model, "grad")
            out = trainer.train_one_step(after_backward=hook)
            result["losses"].append(out.loss)
            result["grad_norms"].append(out.grad_norm)
            if step == 0:
                result["experts"] = out.experts  # the first step is a log step
        sent = {unwrap(m).chunk: unwrap(m).transport.bytes_sent for m in trainer.model}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, sent if parallel_state.get_tensor_model_parallel_rank()
                               == 0 and parallel_state.get_data_parallel_rank() == 0 else {})
        result["bytes_sent"] = {k: v for part in everyone for k, v in part.items()}
        results.append(result)
        del trainer
        destroy_model_parallel()
    return results if dist.get_rank() == 0 else None


class _DataForRank:
    """Builds :class:`SyntheticData` lazily inside the worker (needs the DP rank)."""

    def __init__(self, run: RunConfig):
        self.run = run
        self._data = None

    def _get(self):
        if self._data is None:
            from megatron.core import parallel_state

            self._data = SyntheticData(self.run, parallel_state.get_data_parallel_rank(),
                                       parallel_state.get_data_parallel_world_size())
        return self._data

    @property
    def train_iterator(self):
        return self._get().train_iterator

    def valid_iterator(self):
        return self._get().valid_iterator()


def assert_same_training(ours: dict, ref: dict, label: str, loss_rtol: float,
                         grad_rtol: Optional[float] = None) -> float:
    """Two :func:`run_layouts` results trained alike: each step's loss within ``loss_rtol``
    (relative) and, when the results hold step-1 gradients, each parameter's gradient error
    within ``grad_rtol`` of the global gradient norm. Returns the total gradient error
    relative to that norm (0 without gradients)."""
    import math

    assert len(ours["losses"]) == len(ref["losses"]), label
    for step, (a, b) in enumerate(zip(ours["losses"], ref["losses"])):
        assert math.isclose(a, b, rel_tol=loss_rtol), f"{label}: loss step {step + 1}: {a} vs {b}"
    if "grads" not in ref:
        return 0.0
    assert set(ours["grads"]) == set(ref["grads"]), f"{label}: parameter names differ"
    norm = math.sqrt(sum(g.double().pow(2).sum().item() for g in ref["grads"].values()))
    total = 0.0
    for name, g_ref in ref["grads"].items():
        err = (ours["grads"][name] - g_ref).double().norm().item()
        total += err**2
        assert err <= grad_rtol * norm, f"{label}: grad {name} err {err / norm:.2e} of the norm"
    return math.sqrt(total) / norm


def run_layouts(runs: list, world_size: int, steps: int = 3, timeout: float = 600.0,
                mode: str = "parity") -> list:
    """Train each run for ``steps`` steps in one group of ``world_size`` gloo processes.

    Returns, per run: ``losses`` and ``grad_norms`` per step, ``grads`` (full, by global
    name, after step 1's backward, before the optimizer), ``init_params``, payload
    ``bytes_sent`` per chunk, and with experts step 1's ``experts``
    (:class:`~depthmix.pretrain.experts.ExpertLoad`).
    """
    return spawn(_train_runs, world_size, (runs, steps, mode), timeout=timeout)[0]


def run_layout(run: RunConfig, world_size: int, steps: int = 3, **kwargs) -> dict:
    return run_layouts([run], world_size, steps, **kwargs)[0]
