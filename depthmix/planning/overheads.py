"""The Depth-Attention paper's Table 2 for every mixer, from our hooks (``depthmix-overheads``:
:mod:`depthmix.cli.overheads`).

Per mixer, beyond the vanilla decoder of the same preset: extra forward FLOPs (per layer,
mean over the unrolled layers, and per token for the whole model, with the share of the
vanilla forward), extra activation I/O (the same two ways, in bytes of 16-bit activations
unless ``--bytes`` says otherwise), extra persistent state for a prefill of ``--prefill``
tokens, extra parameters, and the extra bytes the largest pipeline stage boundary carries
per micro-batch of one sequence (at ``parallel.pp``, default 4).

One source of truth: FLOPs come from each mixer's ``extra_flops_per_token`` hook (the
training accounting's MFU uses the same), I/O from ``extra_io_per_token``, state from
``extra_state_per_token`` (or, for hidden-state methods, the plan), parameters from
``extra_params`` and pipeline bytes from the transport geometry the model itself runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List


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


def overheads(run, prefill: int = 131072, element_size: int = 2) -> Overheads:
    """Extra costs of ``run``'s mixer over the vanilla decoder of the same model."""
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.planning.pipeline import PipelineLayout
    from depthmix.mixers import get_mixer
    from depthmix.mixers.base import state_per_token
    from depthmix.megatron_ext.transport import geometry_of
    from depthmix.planning import flops as accounting

    config = to_transformer_config(run)
    mixer = get_mixer(run.mixer.name)
    flops = accounting.flops_per_token(run, config)
    vanilla_forward = flops["forward"] - flops["mixer"]
    p = run.parallel
    layout = PipelineLayout(config.num_layers, p.pp, p.vp or 1)
    geometry = geometry_of(config, layout, p.tp)
    hidden_rows = config.seq_length // (p.tp if p.sequence_parallel else 1)
    vanilla_payload = hidden_rows * config.hidden_size * element_size
    pipeline = max((geometry.payload_bytes(c, 1, element_size) - vanilla_payload
                    for c in range(1, layout.num_chunks)), default=0)
    return Overheads(
        mixer=run.mixer.name,
        layers=config.unrolled_layers,
        flops_per_token=flops["mixer"],
        flops_share=flops["mixer"] / vanilla_forward,
        io_bytes_per_token=float(mixer.extra_io_per_token(config)) * element_size,
        state_bytes=state_per_token(mixer, config) * prefill * element_size,
        params=mixer.extra_params(config, 1).total,
        pipeline_bytes=pipeline,
    )


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def table(rows: List[Overheads], prefill: int) -> str:
    from depthmix.planning.flops import human

    head = ("mixer", "FLOPs/layer", "FLOPs/token", "% of model", "I/O per layer",
            "I/O per token", f"state @{prefill // 1024}K", "params", "pipeline/boundary")
    body = [(r.mixer, human(r.flops_per_layer), human(r.flops_per_token),
             f"{100 * r.flops_share:.4f}%", _size(r.io_bytes_per_layer),
             _size(r.io_bytes_per_token), _size(r.state_bytes), human(r.params),
             _size(r.pipeline_bytes)) for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in (head, *body)]
    return "\n".join(lines)
