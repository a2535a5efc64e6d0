"""The fast path's switches on the CPU (docs/operations.md, "Fast path"):

* ``train.fused_optimizer``: the fused step trains as the plain one (fp32, bf16; fused and
  foreach kernels), reads the host once per step where Megatron's fallback reads it once per
  parameter tensor, keeps its kernel flags through a checkpoint's optimizer state;
* ``train.fused_cross_entropy``: the chunked loss equals the plain one in loss and gradients
  (fp64/fp32/bf16 against an fp64 reference, chunk boundaries, the model's tied and untied
  head) and saves no logits for backward; at TP2 and TP2 with sequence parallelism, and the
  fused optimizer under DP2 with the distributed optimizer, through the trainer
  (``test_two_ranks``, two gloo ranks);
* ``train.cuda_graphs``: refused on the CPU and without compilation, naming the option; the
  compile call gets ``mode="reduce-overhead"``;
* attention takes SDPA's fused (flash) kernel with GQA and no K/V copy; a bf16 model's
  modules all return bf16 (the RMSNorm statistics and the loss stay inside).
"""

import collections
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from depthmix.config.schema import ConfigError
from depthmix.testing import SyntheticData, build_model, run_layouts, tiny_run


def _trainer(precision="fp32", fused_optimizer="false", fused_cross_entropy="false", **train):
    from depthmix.pretrain.trainer import Trainer

    run = tiny_run("vanilla")
    run.train.precision = precision
    run.train.fused_optimizer = fused_optimizer
    run.train.fused_cross_entropy = fused_cross_entropy
    run.train.micro_batch_size, run.train.global_batch_size = 2, 4
    for key, value in train.items():
        setattr(run.train, key, value)
    return Trainer(run, data=SyntheticData, callbacks=[])


def _train(trainer, steps=3):
    results = [trainer.train_one_step() for _ in range(steps)]
    weights = torch.cat([p.detach().double().flatten() for p in trainer.model[0].parameters()])
    return [r.loss for r in results], [r.grad_norm for r in results], weights


def _inner(trainer):
    from depthmix.pretrain.optim import megatron_optimizers

    return [opt.optimizer for opt in megatron_optimizers(trainer.optimizer)]


# ------------------------------------------------------------------------ fused optimizer
@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-6), ("bf16", 2e-3)])
@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_fused_optimizer_trains_as_the_plain_one(megatron_single, precision, rtol, kernel):
    from depthmix.pretrain.optim import use_fused_step

    plain = _train(_trainer(precision))
    trainer = _trainer(precision)
    use_fused_step(trainer.optimizer, kernel)
    assert all(g["fused"] == (kernel == "fused") and g["foreach"] == (kernel == "foreach")
               for opt in _inner(trainer) for g in opt.param_groups)
    fused = _train(trainer)
    # the same gradients: the norm's arithmetic is Megatron's, up to the fp64 order of its sum
    assert fused[1][0] == pytest.approx(plain[1][0], rel=1e-12, abs=0)
    assert fused[0] == pytest.approx(plain[0], rel=rtol)
    assert fused[1] == pytest.approx(plain[1], rel=rtol * 10)
    assert ((fused[2] - plain[2]).norm() / plain[2].norm()).item() < rtol


def test_fused_optimizer_switch(megatron_single, monkeypatch):
    from depthmix.pretrain.optim import fused_enabled, fused_step

    trainer = _trainer(fused_optimizer="true")
    assert fused_step(trainer.optimizer)
    assert all(g["fused"] for opt in _inner(trainer) for g in opt.param_groups)  # CPU has it
    assert not fused_step(_trainer(fused_optimizer="auto").optimizer)  # auto: off on CPU
    run = tiny_run()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fused_enabled(run) and not fused_enabled(_with(run, fused_optimizer="false"))


def _with(run, **train):
    run = copy.deepcopy(run)
    for key, value in train.items():
        setattr(run.train, key, value)
    return run


class HostReads(TorchDispatchMode):
    """Counts what makes the host wait for the device: scalar reads (``.item()``,
    ``float()``, ``bool()`` of a tensor: ``aten._local_scalar_dense``, also from C++) and
    ``Tensor.tolist``/``cpu``/``numpy`` calls; and every op dispatched."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.calls = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._saved, inside = {}, []

        for name in ("tolist", "cpu", "numpy"):
            original = self._saved[name] = getattr(torch.Tensor, name)

            def counted(tensor, *a, _name=name, _original=original, **k):
                # once per call: the CPU shim's torch-function mode calls the method again
                self.calls[_name] += not inside
                inside.append(1)
                try:
                    return _original(tensor, *a, **k)
                finally:
                    inside.pop()

            setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    @property
    def scalar_reads(self) -> int:
        return self.ops["aten._local_scalar_dense.default"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_host_read_per_step(megatron_single, monkeypatch, precision):
    """The fused step reads the host once (loss, gradient norm and loss scale together) and
    makes no scalar read; Megatron's fallback reads one scalar per parameter tensor."""
    from depthmix.pretrain import optim, step

    reads = {}
    original = step.optimizer_step

    def counted(optimizer, totals, check=None):
        with HostReads() as probe:
            result = original(optimizer, totals, check)
        reads[optim.fused_step(optimizer)] = probe
        return result

    monkeypatch.setattr(step, "optimizer_step", counted)
    tensors = 0
    for fused in ("false", "true"):
        trainer = _trainer(precision, fused_optimizer=fused)
        trainer.train_one_step()  # AdamW's state is made on the first step
        trainer.train_one_step()
        tensors = sum(1 for _ in trainer.model[0].parameters())
    plain, fused = reads[False], reads[True]
    assert fused.scalar_reads == 0 and dict(fused.calls) == {"tolist": 1}, (fused.ops,
                                                                           fused.calls)
    assert plain.scalar_reads >= tensors  # the local multi_tensor_l2norm: one per tensor
    assert sum(fused.ops.values()) < sum(plain.ops.values()) / 10


def test_grad_norm_and_clipping_are_megatrons(megatron_single):
    """On the same gradients: the norm bit for bit, the clipped gradients too (the
    coefficient is computed in float64 and applied in fp32 either way)."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    from depthmix.pretrain import optim

    trainer = _trainer(clip_grad=0.5)
    step_ = trainer.train_one_step
    step_()
    optimizer = trainer.optimizer
    for chunk in trainer.model:
        chunk.zero_grad_buffer()
    from depthmix.pretrain.step import run_schedule

    run_schedule(trainer.model, [next(trainer.data.train_iterator) for _ in range(2)],
                 trainer.run.model.seq_length, forward_only=False)
    optimizer.prepare_grads()
    params = optimizer.get_parameters()
    grads = [p.grad.clone() for p in params]
    expected = optimizer.get_grad_norm()
    norm = optim.grad_norm(optimizer)
    assert norm.dtype == torch.float64 and norm.item() == expected
    optim.clip_grads(optimizer, norm)
    ours = [p.grad.clone() for p in params]
    for p, g in zip(params, grads):
        p.grad.copy_(g)
    clip_grad_by_total_norm_fp32(params, 0.5, expected)
    assert expected > 0.5 and all(torch.equal(a, p.grad) for a, p in zip(ours, params))


def test_fused_flags_and_steps_survive_a_checkpoint_state(megatron_single):
    """A plain run's optimizer state loaded into a fused optimizer (a resume with the switch
    turned on) keeps the fused kernel, with each ``step`` a float32 tensor on the
    parameter's device, whatever the saved state held."""
    plain = _trainer()
    plain.train_one_step()
    saved = plain.optimizer.state_dict()
    for state in saved["state"].values():
        state["step"] = 1  # Megatron's common-step restore may hand back a number
    fused = _trainer(fused_optimizer="true")
    fused.optimizer.load_state_dict(copy.deepcopy(saved))
    for opt in _inner(fused):
        assert all(g["fused"] and not g["foreach"] for g in opt.param_groups)
        for group in opt.param_groups:
            for p in group["params"]:
                step_ = opt.state[p]["step"]
                assert torch.is_tensor(step_) and step_.dtype == torch.float32
                assert step_.device == p.device and step_.item() == 1
    fused.train_one_step()  # the fused kernel takes the loaded state


# ------------------------------------------------------------------------ fused loss
def _exact(hidden, weight, labels):
    logits = hidden.double() @ weight.double().t()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           reduction="none").view(labels.shape)


def _loss_and_grads(fn, hidden, weight, labels, grad):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss = fn(hidden, weight, labels)
    return (loss, *torch.autograd.grad(loss, (hidden, weight), grad.to(loss.dtype)))


def _megatron_loss(hidden, weight, labels):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(hidden @ weight.t(), labels)


@pytest.mark.parametrize("dtype, rtol", [(torch.float64, 1e-12), (torch.float32, 2e-6),
                                         (torch.bfloat16, None)])
@pytest.mark.parametrize("chunk", [7, 16, 64, 1000])  # ragged, exact, one chunk, > tokens
def test_fused_cross_entropy_equals_the_plain_loss(megatron_single, dtype, rtol, chunk):
    from depthmix.megatron_ext.loss import linear_cross_entropy

    torch.manual_seed(0)
    s, b, h, v = 16, 4, 24, 300
    hidden, weight = torch.randn(s, b, h), torch.randn(v, h) / 4
    labels = torch.randint(0, v, (s, b))
    labels[0, 0], labels[1, 0] = 0, v - 1
    grad = torch.randn(s, b)
    exact = _loss_and_grads(_exact, hidden.double(), weight.double(), labels, grad.double())
    fused = _loss_and_grads(lambda x, w, y: linear_cross_entropy(x, w, y, chunk=chunk),
                            hidden.to(dtype), weight.to(dtype), labels, grad)
    plain = _loss_and_grads(_megatron_loss, hidden.to(dtype), weight.to(dtype), labels, grad)
    assert fused[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert fused[1].dtype == fused[2].dtype == dtype
    for name, ours, theirs, ref in zip(("loss", "hidden", "weight"), fused, plain, exact):
        assert ours.shape == ref.shape, name
        error = ((ours.double() - ref).norm() / ref.norm()).item()
        if rtol is not None:
            assert error < rtol, (name, error)
        else:  # bf16: as close to the exact values as Megatron's path is (rounding-limited)
            plain_error = ((theirs.double() - ref).norm() / ref.norm()).item()
            assert error < 1.5 * plain_error + 1e-3, (name, error, plain_error)


@pytest.mark.parametrize("tied", [False, True])
def test_model_loss_and_gradients_fused_vs_plain(megatron_single, tied):
    torch.manual_seed(0)
    runs = {}
    for mode in ("false", "true"):
        run = tiny_run("vanilla")
        run.model.tie_embeddings = tied
        run.train.fused_cross_entropy = mode
        runs[mode] = build_model(run)
    runs["true"].load_state_dict(runs["false"].state_dict())
    assert runs["true"].config.fused_cross_entropy and not runs["false"].config.fused_cross_entropy
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    out = {}
    for mode, model in runs.items():
        loss = model(tokens, positions, labels=tokens.roll(-1, 1))
        (loss * torch.linspace(0.5, 1.5, loss.numel()).view_as(loss)).sum().backward()
        out[mode] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (plain, plain_grads), (fused, fused_grads) = out["false"], out["true"]
    assert fused.shape == plain.shape == (2, 16)
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    assert plain_grads.keys() == fused_grads.keys()
    for name, g in plain_grads.items():
        error = ((fused_grads[name] - g).norm() / g.norm()).item()
        assert error < 1e-5, (name, error)
    logits = runs["true"](tokens, positions)  # without labels: the logits, as before
    assert logits.shape == (2, 16, runs["true"].vocab_size)


def _saved_bytes(fn, *args) -> tuple:
    """(total, largest) bytes of the tensors autograd saves for backward while ``fn`` runs
    (parameters and inputs included, as saved)."""
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(sizes), max(sizes)


def test_fused_cross_entropy_saves_no_logits(megatron_single):
    from depthmix.megatron_ext.loss import linear_cross_entropy

    s, b, h, v = 256, 2, 32, 4096  # vocabulary-heavy: logits are 64x the hidden states
    hidden = torch.randn(s, b, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    labels = torch.randint(0, v, (s, b))
    plain, plain_max = _saved_bytes(_megatron_loss, hidden, weight, labels)
    fused, fused_max = _saved_bytes(lambda *a: linear_cross_entropy(*a, chunk=128),
                                    hidden, weight, labels)
    logits_fp32 = s * b * v * 4
    assert plain >= logits_fp32 and plain_max >= logits_fp32
    assert fused_max < logits_fp32 / 8 and fused < plain / 8, (fused, plain)


# ------------------------------------------------------------------------ CUDA graphs
def test_cuda_graphs_refused_on_cpu_and_without_compile(monkeypatch):
    from depthmix.config.validate import validate
    from depthmix.pretrain import preflight

    run = tiny_run()
    run.train.cuda_graphs = True
    monkeypatch.setattr(preflight, "_has_cuda_device", lambda: False)
    with pytest.raises(ConfigError, match=r"^train.cuda_graphs=true needs a CUDA GPU"):
        preflight.check_cuda_graphs(run)
    monkeypatch.setattr(preflight, "_has_cuda_device", lambda: True)
    preflight.check_cuda_graphs(run)  # auto compiles on the GPU
    run.train.compile = "false"
    with pytest.raises(ConfigError, match=r"^train.cuda_graphs=true needs train.compile=true"):
        validate(run)


def test_cuda_graphs_wiring(megatron_single, monkeypatch):
    """The compiled layers get ``mode="reduce-overhead"`` (CUDA-graph trees) and each step
    marks its start for them; without the option neither (nothing compiles here)."""
    from depthmix.megatron_ext.layer import DepthMixLayer
    from depthmix.pretrain import compile as compile_mod

    calls, marks = [], []
    monkeypatch.setattr(DepthMixLayer, "compile", lambda self, **kw: calls.append(kw))
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = build_model(tiny_run())
    for graphs, mode in ((True, {"mode": "reduce-overhead"}), (False, {})):
        calls.clear(), marks.clear()
        assert compile_mod.compile_layers([model], cuda_graphs=graphs) == 4
        assert calls == [mode] * 4
        compile_mod.step_begin()
        assert marks == ([1] if graphs else [])


def test_fast_path_options_on_the_command_line():
    from depthmix.config.load import compose_run
    from depthmix.config.validate import validate

    run = compose_run("model=tiny", "train.fused_optimizer=True", "train.fused_cross_entropy=false",
                      "train.cuda_graphs=true", "train.compile=true")
    assert (run.train.fused_optimizer, run.train.fused_cross_entropy) == ("true", "false")
    assert run.train.cuda_graphs is True
    validate(run)
    run.train.fused_optimizer = "fused"
    with pytest.raises(ConfigError, match="train.fused_optimizer='fused' is not one of auto"):
        validate(run)


# ------------------------------------------------------------------------ roofline
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_takes_the_fused_kernel_with_gqa(dtype):
    """SDPA's fused kernel (flash, on CPU too) for the causal square with GQA: K/V at their
    own heads, the head dim contiguous, no copy of the ``[s, b, heads, hn]`` inputs."""
    from torch.nn.attention import SDPBackend

    from depthmix.megatron_ext.attention import _sdpa_call, causal_sdpa, sdpa_backend

    s, b, np_, ng, hn = 32, 2, 8, 2, 16
    qkv = torch.randn(s, b, np_ + 2 * ng, hn, dtype=dtype)  # one projection, split as Megatron
    q, k, v = qkv.split([np_, ng, ng], dim=2)
    assert sdpa_backend(q, k, v) == SDPBackend.FLASH_ATTENTION
    args = _sdpa_call(q, k, v, None)
    assert all(t.data_ptr() == src.data_ptr() and t.stride(-1) == 1
               for t, src in zip(args[:3], (q, k, v)))
    assert args[1].shape[1] == ng and args[3] is None and args[4] is True
    out = causal_sdpa(q, k, v)
    assert out.dtype == dtype and out.shape == (s, b, np_ * hn)


def test_bf16_modules_return_bf16(megatron_single):
    """Every module of a bf16 model returns bf16 (no stray fp32 activation between
    modules): fp32 stays inside the norms' statistics and the loss; RoPE's frequency table
    is fp32 and cast where applied. Attention gets bf16 Q/K/V."""
    run = tiny_run("depth_attn")
    run.train.precision = "bf16"
    run.train.fused_cross_entropy = "true"
    model = build_model(run)
    fp32_outputs = set()

    def hook(module, args, output):
        outputs = output.values() if isinstance(output, dict) else (
            output if isinstance(output, (tuple, list)) else (output,))
        if any(torch.is_tensor(t) and t.dtype == torch.float32 for t in outputs):
            fp32_outputs.add(type(module).__name__)

    for module in model.modules():
        module.register_forward_hook(hook)
    seen = []
    original = F.scaled_dot_product_attention

    def sdpa(q, k, v, **kw):
        seen.append({q.dtype, k.dtype, v.dtype})
        return original(q, k, v, **kw)

    tokens = torch.randint(0, 128, (2, 16))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", sdpa)
        loss = model(tokens, torch.arange(16).expand(2, 16), labels=tokens)
    loss.sum().backward()
    assert loss.dtype == torch.float32 and seen and all(s == {torch.bfloat16} for s in seen)
    assert "RotaryEmbedding" in fp32_outputs  # (the hooks see every module)
    assert fp32_outputs <= {"RotaryEmbedding", "OutputLayer", "DepthMixModel"}, fp32_outputs


# ------------------------------------------------------------------------ two ranks
def _two_rank_runs() -> dict:
    def run(**kw):
        r = tiny_run("vanilla")
        r.train.micro_batch_size, r.train.global_batch_size = 2, 4
        for key, value in kw.items():
            group, name = key.split("__")
            setattr(getattr(r, group), name, value)
        return r

    return {
        "tp2 plain": run(parallel__tp=2),
        "tp2 fused loss": run(parallel__tp=2, train__fused_cross_entropy="true"),
        "tp2-sp fused loss": run(parallel__tp=2, parallel__sequence_parallel=True,
                                 train__fused_cross_entropy="true"),
        "dp2-distopt plain": run(parallel__distributed_optimizer=True),
        "dp2-distopt fused step": run(parallel__distributed_optimizer=True,
                                      train__fused_optimizer="true"),
    }


@pytest.mark.multiproc
@pytest.mark.timeout(600)
def test_two_ranks():
    """Through the trainer on two gloo ranks, three steps: the fused loss at TP2 (vocabulary
    split over the ranks) and TP2 with sequence parallelism equals the plain TP2 run in
    losses and step-1 gradients; the fused optimizer step with the distributed optimizer
    (DP2: shards copied into the parameter buffer in one op) equals the plain one."""
    from depthmix.testing import assert_same_training

    runs = _two_rank_runs()
    results = dict(zip(runs, run_layouts(list(runs.values()), world_size=2)))
    for label in ("tp2 fused loss", "tp2-sp fused loss"):
        assert_same_training(results[label], results["tp2 plain"], label, 1e-6, 1e-5)
    assert_same_training(results["dp2-distopt fused step"], results["dp2-distopt plain"],
                         "dp2-distopt", 1e-6, 1e-6)
    assert all(math.isfinite(x) for r in results.values() for x in r["losses"])
