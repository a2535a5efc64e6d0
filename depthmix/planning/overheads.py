"""``depthmix-overheads``: the Depth-Attention paper's Table 2 for every mixer, from our hooks.

    depthmix-overheads model=3b
    depthmix-overheads model=1p5b parallel.pp=4 --prefill 131072 --mixers depth_attn,mhc

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
Options (``model=...``, ``mixer.<option>`` for a single mixer, ``parallel.pp=...``) are
Hydra overrides of the training config.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence

from depthmix.planning.flops import flops_per_token, mixer_of
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


def overheads(run, prefill: int = 131072, element_size: int = 2) -> Overheads:
    """Extra costs of ``run``'s mixer over the vanilla decoder of the same model."""
    from depthmix.mixers.base import state_per_token

    shape = Shape.of(run)
    mixer = mixer_of(run)
    flops = flops_per_token(run)
    vanilla_forward = flops["forward"] - flops["mixer"]
    p = run.parallel
    layout = PipelineLayout(shape.num_layers, p.pp, p.vp or 1)
    geometry = geometry_of(shape, layout, p.tp)
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
        state_bytes=state_per_token(mixer, shape) * prefill * element_size,
        params=mixer.extra_params(shape, 1).total,
        pipeline_bytes=pipeline,
    )


def table(rows: List[Overheads], prefill: int) -> str:
    head = ("mixer", "FLOPs/layer", "FLOPs/token", "% of model", "I/O per layer",
            "I/O per token", f"state @{prefill // 1024}K", "params", "pipeline/boundary")
    body = [(r.mixer, human(r.flops_per_layer), human(r.flops_per_token),
             f"{100 * r.flops_share:.4f}%", fmt_bytes(r.io_bytes_per_layer),
             fmt_bytes(r.io_bytes_per_token), fmt_bytes(r.state_bytes), human(r.params),
             fmt_bytes(r.pipeline_bytes)) for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(line, widths)) for line in (head, *body)]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="depthmix-overheads", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=3b parallel.pp=4")
    parser.add_argument("--mixers", default="all", help="comma-separated (default: every mixer)")
    parser.add_argument("--prefill", type=int, default=131072,
                        help="prefill length for the state column (default 128K tokens)")
    parser.add_argument("--bytes", type=int, default=2, dest="element_size",
                        help="bytes per activation element (default 2: fp16/bf16)")
    args = parser.parse_args(argv)

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from depthmix.config.load import compose_run
    from depthmix.config.schema import ConfigError
    from depthmix.mixers import available

    names = available() if args.mixers == "all" else args.mixers.split(",")
    overrides = list(args.overrides)
    if not any(o.startswith(("parallel.pp=", "parallel=")) for o in overrides):
        overrides.append("parallel.pp=4")
    try:
        rows = [overheads(compose_run(*overrides, f"mixer={name}"), args.prefill,
                          args.element_size) for name in names]
    except (ConfigError, HydraException, OmegaConfBaseException) as e:
        print(f"depthmix-overheads: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    model = next((o for o in overrides if o.startswith("model=")), "model=tiny")
    print(f"extra cost over the vanilla decoder, {model}, {args.element_size}-byte activations; "
          f"FLOPs forward (2 per multiply-add); pipeline bytes per micro-batch of one sequence")
    print(table(rows, args.prefill))
    return 0


if __name__ == "__main__":
    sys.exit(main())
