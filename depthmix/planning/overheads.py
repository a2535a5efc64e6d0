"""The Depth-Attention paper's Table 2 for every mixer, from our hooks (``depthmix-overheads``:
:mod:`depthmix.cli.overheads`).

Per mixer, beyond the vanilla decoder of the same preset: extra forward FLOPs (per layer,
mean over the unrolled layers, and per token for the whole model, with the share of the
vanilla forward), extra activation I/O (the same two ways, in bytes of 16-bit activations
unless ``--bytes`` says otherwise), extra persistent state for a prefill of ``--prefill``
tokens, extra parameters, and the extra bytes the largest pipeline stage boundary carries
per micro-batch of one sequence (at ``parallel.pp``, default 4).

With experts (``model.moe``) the table is the same mixers' cost over the same decoder with
its MoE layers: a depth mixer treats an MoE sublayer as an FFN, so its own FLOPs, I/O,
state, parameters and pipeline bytes do not change with experts; what changes is the
share, "% of model", taken of the vanilla forward counted by *activated* parameters (the
router, the top-k experts a token is routed to, the shared expert), as MFU counts it.

One source of truth: FLOPs come from each mixer's ``extra_flops_per_token`` hook (the
training accounting's MFU uses the same), I/O from ``extra_io_per_token``, state from
``extra_state_per_token`` (or, for hidden-state methods, the plan), parameters from
``extra_params`` and pipeline bytes from the transport geometry the model itself runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from tabulate import tabulate

from depthmix.planning.flops import flops_per_token
from depthmix.planning.pipeline import PipelineLayout, geometry_of
from depthmix.planning.shape import Shape
from depthmix.planning.units import fmt_bytes, human


@dataclass
class Overheads:
    mixer: str
    layers: int
    flops_per_token: float
    flops_share: float  # of the vanilla forward per token
    io_bytes_per_token: float
    state_bytes: float  # at the prefill length
    params: int
    pipeline_bytes: int  # largest stage boundary, per micro-batch of one sequence

    @property
    def flops_per_layer(self) -> float:
        return self.flops_per_token / self.layers

    @property
    def io_bytes_per_layer(self) -> float:
        return self.io_bytes_per_token / self.layers


def overheads(run, mixer, prefill: int = 131072, element_size: int = 2) -> Overheads:
    """Extra costs of ``run``'s ``mixer`` (its :class:`~depthmix.mixers.base.Mixer`) over
    the vanilla decoder of the same model."""
    shape = Shape.of(run)
    flops = flops_per_token(run, mixer)
    vanilla_forward = flops["forward"] - flops["mixer"]
    p = run.parallel
    layout = PipelineLayout(shape.num_layers, p.pp, p.vp or 1)
    geometry = geometry_of(mixer.plan, shape, layout, p.tp)
    hidden_rows = shape.seq_length // (p.tp if p.sequence_parallel else 1)
    vanilla_payload = hidden_rows * shape.hidden_size * element_size
    pipeline = max((geometry.payload_bytes(c, 1, element_size) - vanilla_payload
                    for c in range(1, layout.num_chunks)), default=0)
    return Overheads(
        mixer=run.mixer.name,
        layers=shape.unrolled_layers,
        flops_per_token=flops["mixer"],
        flops_share=flops["mixer"] / vanilla_forward,
        io_bytes_per_token=float(mixer.extra_io_per_token(shape)) * element_size,
        state_bytes=mixer.state_per_token(shape) * prefill * element_size,
        params=mixer.extra_params(shape, 1).total,
        pipeline_bytes=pipeline,
    )


def experts_note(run, vanilla) -> str:
    """The line the table of an MoE model opens with: what its shares are of (``vanilla``:
    the vanilla :class:`~depthmix.mixers.base.Mixer`)."""
    e, f = run.model.experts, flops_per_token(run, vanilla)
    return (f"experts: {e.num_experts} routed, top-{e.top_k} a token; '% of model' is of the "
            f"vanilla forward by activated parameters ({human(f['forward'])} a token, of "
            f"which MoE layers {human(f['moe'])}); the mixers' own costs do not depend on "
            "the experts")


def table(rows: List[Overheads], prefill: int) -> str:
    head = ("mixer", "FLOPs/layer", "FLOPs/token", "% of model", "I/O per layer",
            "I/O per token", f"state @{prefill // 1024}K", "params", "pipeline/boundary")
    body = [(r.mixer, human(r.flops_per_layer), human(r.flops_per_token),
             f"{100 * r.flops_share:.4f}%", fmt_bytes(r.io_bytes_per_layer),
             fmt_bytes(r.io_bytes_per_token), fmt_bytes(r.state_bytes), human(r.params),
             fmt_bytes(r.pipeline_bytes)) for r in rows]
    return tabulate(body, head, tablefmt="plain", disable_numparse=True)
