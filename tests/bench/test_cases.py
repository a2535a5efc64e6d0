"""The kernel benchmarks (``depthmix/bench/<op>.py``) time what they claim to.

* Smoke shapes (CPU, ``ours`` in the Triton interpreter): every candidate runs forward and
  backward once; ``ours`` (and ``ours+<attn>``) agrees with ``torch`` (``torch+<attn>``) on
  every output and every input gradient (fp32); the reference and plain-attention
  candidates equal the ops called as the stack calls them, with the mixers' default options
  (catches a wrapper that passes the wrong arguments to both sides alike).
* Full shapes, built under a pretended CUDA device without allocating anything (``cases``
  only builds closures; the inputs are made inside ``FakeTensorMode``): ``T`` = 4K, 16K,
  64K, ``G`` = 1, 4, 8 where it applies, bf16 activations.
"""

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from depthmix import kernels
from depthmix.config.schema import ModelConfig
from depthmix.kernels.attnres import attnres_reference
from depthmix.kernels.ddl import ddl_read_reference, ddl_write_reference
from depthmix.kernels.depth_mix.reference import depth_mix_reference
from depthmix.kernels.dispatch import triton_status
from depthmix.kernels.mhc import mhc_post_res_reference, mhc_read_reference, sinkhorn_reference
from depthmix.kernels.moda_attention import moda_attention_reference
from depthmix.megatron_ext.attention import causal_sdpa
from depthmix.mixers.ddl import DDLConfig
from depthmix.mixers.mhc import MHCConfig

OPS = kernels.ops()
FULL_T = {4096, 16384, 65536}
EPS = ModelConfig().norm_epsilon
MHC = MHCConfig()
DDL = DDLConfig()


def _mhc_read(x, phi, alpha, bias):
    x_in, _, h_post, h_res = mhc_read_reference(x, phi, alpha, bias, MHC.variant,
                                                 MHC.sinkhorn_iters, EPS)
    return x_in, h_post, h_res


# (op, first word of the case's shape) -> candidate -> the stack's call on the case's args
STACK_CALLS = {
    ("depth_mix", "op"): {"torch": lambda q, k, v, sk, sv: depth_mix_reference(q, k, v, sk, sv)[1]},
    ("depth_mix", "attn+mix"): {
        "sdpa": lambda q, k, v, sk, sv: causal_sdpa(q, k, v),
        "torch+sdpa": lambda q, k, v, sk, sv: causal_sdpa(
            q, k, depth_mix_reference(q, k, v, sk, sv)[1]),
    },
    ("moda_attention", "moda"): {
        "sdpa": lambda q, k, v, dk, dv: causal_sdpa(q, k, v),
        "torch": lambda q, k, v, dk, dv: moda_attention_reference(q, k, v, dk, dv),
    },
    ("attnres", "full"): {"torch": lambda s, q, w: attnres_reference(s, q, w, EPS)},
    ("attnres", "block"): {"torch": lambda s, q, w: attnres_reference(s, q, w, EPS)},
    ("mhc", "sinkhorn"): {"torch": lambda z, iters: sinkhorn_reference(z, MHC.sinkhorn_iters)},
    ("mhc", "read"): {"torch": _mhc_read},
    ("mhc", "post_res"): {
        "torch": lambda x, y, hp, hr: mhc_post_res_reference(x, y, hp, hr).to(x.dtype)},
    ("ddl", "read"): {"torch": ddl_read_reference},
    ("ddl", "write"): {"torch": lambda *args: ddl_write_reference(*args, DDL.v_scale, EPS)[0]},
}


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _outputs(out):
    out = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in out if isinstance(o, torch.Tensor) and o.requires_grad]


def _run(case, fn):
    """Outputs and input gradients of one candidate on the case's (seeded) inputs."""
    torch.manual_seed(0)
    args, kwargs = case.make_inputs()
    outs = _outputs(fn(*args, **kwargs))
    assert outs and all(torch.isfinite(o).all() for o in outs)
    torch.manual_seed(1)
    torch.autograd.backward(outs, [torch.randn_like(o) for o in outs])
    leaves = [a for a in _flat(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


def _close(name, ours, ref):
    assert len(ours) == len(ref), name
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert (a is None) == (b is None), f"{name}[{i}]: a gradient is missing"
        if a is not None:
            scale = max(1.0, b.abs().max().item())
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * scale, msg=f"{name}[{i}]")


@pytest.mark.parametrize("op", OPS)
def test_smoke_candidates_run_and_agree(op):
    cases = importlib.import_module(f"depthmix.bench.{op}").cases(smoke=True)
    assert cases
    for case in cases:
        assert case.baseline in case.candidates, case.shape
        if triton_status()[0]:
            assert any("ours" in name for name in case.candidates), case.shape
        results = {name: _run(case, fn) for name, fn in case.candidates.items()}
        for name, (outs, grads) in results.items():
            if "ours" in name and name.replace("ours", "torch") in results:
                ref_outs, ref_grads = results[name.replace("ours", "torch")]
                _close(f"{case.shape} {name} outputs", outs, ref_outs)
                _close(f"{case.shape} {name} grads", grads, ref_grads)
        kind = case.shape.split()[0]
        assert (op, kind) in STACK_CALLS, f"STACK_CALLS lacks the stack's call of {op} {kind}"
        calls = STACK_CALLS[(op, kind)]
        for name, call in calls.items():
            torch.manual_seed(0)
            args, kwargs = case.make_inputs()
            _close(f"{case.shape} {name} vs the stack's call", results[name][0],
                   [o.detach() for o in _outputs(call(*args, **kwargs))])


def _fake_full_cases(op, monkeypatch):
    """``cases(smoke=False)`` as on a GPU; allocating while building them fails."""
    bench = importlib.import_module(f"depthmix.bench.{op}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with monkeypatch.context() as m:
        for fn in ("randn", "empty", "zeros", "ones", "tensor"):
            m.setattr(torch, fn, lambda *a, **k: pytest.fail("cases() allocated"))
        return bench, bench.cases(smoke=False)


def _inputs(case):
    with FakeTensorMode():
        args, _ = case.make_inputs()
    return [a for a in _flat(args) if isinstance(a, torch.Tensor)]


def test_full_shapes_moda_attention(monkeypatch):
    bench, cases = _fake_full_cases("moda_attention", monkeypatch)
    assert {(s.t, s.g, s.dtype) for s in bench.shapes(False)} == {
        (t, g, torch.bfloat16) for t in FULL_T for g in (1, 4, 8)}
    paper = [c for c in cases if c.shape.startswith("moda/paper")]
    cases = [c for c in cases if not c.shape.startswith("moda/paper")]
    # the MoDA paper's kernel table, row by row: T, G, KV heads 8, head dim 64, depth L
    assert len(paper) == len(bench.PAPER_ROWS) == 11
    for case, (row, t, g, hq, hk, depth, fa2, moda) in zip(paper, bench.PAPER_ROWS):
        q, k, v, dk, dv = _inputs(case)
        assert (q.shape[0], q.shape[2], k.shape[2], q.shape[3], dk.shape[3]) == \
            (t, hq, hk, 64, depth)
        assert f"(paper x{moda / fa2:.3f})" in case.shape and "torch" not in case.candidates
    seen = set()
    for case in cases:
        assert case.baseline == "sdpa" and "ours" in case.candidates
        q, k, v, dk, dv = _inputs(case)
        # (no device check: once a test has installed the CPU shim, 'cuda' maps to the CPU)
        assert all(x.dtype == torch.bfloat16 for x in (q, k, v, dk, dv))
        assert dk.shape[3] == bench.depth_entries() == 48
        t, g = q.shape[0], q.shape[2] // k.shape[2]
        assert ("torch" in case.candidates) == ("compile" in case.candidates) == (t <= 16384)
        seen.add((t, g))
    assert seen == {(t, g) for t in FULL_T for g in (1, 4, 8)}


def test_full_shapes_attnres(monkeypatch):
    bench, cases = _fake_full_cases("attnres", monkeypatch)
    assert {s.dtype for s in bench.shapes(False)} == {torch.bfloat16}
    seen = set()
    for case in cases:
        assert {"ours", "torch", "compile"} <= set(case.candidates)
        *sources, query, key_weight = _inputs(case)
        assert all(x.dtype == torch.bfloat16 for x in (*sources, query, key_weight))
        assert sources[0].shape[1:] == (1, 2048)
        seen.add((sources[0].shape[0], len(sources)))
    assert seen == {(t, s) for t in FULL_T for s in (49, 9)}


def test_full_shapes_mhc(monkeypatch):
    bench, cases = _fake_full_cases("mhc", monkeypatch)
    assert {s.dtype for s in bench.shapes(False)} == {torch.bfloat16}
    seen = set()
    for case in cases:
        kind = case.shape.split()[0]
        assert {"ours", "torch", "compile"} <= set(case.candidates)
        tensors = _inputs(case)
        if kind == "sinkhorn":
            assert case.baseline == "compile"
            assert tensors[0].dtype == torch.float32 and tensors[0].shape[1:] == (1, 4, 4)
        else:
            x = tensors[0]
            assert x.dtype == torch.bfloat16 and x.shape[1:] == (1, 4, 2048)
        seen.add((kind, tensors[0].shape[0]))
    assert seen == {(k, t) for k in ("sinkhorn", "read", "post_res") for t in FULL_T}
