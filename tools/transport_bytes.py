#!/usr/bin/env python
"""Bytes each pipeline stage transition carries, per mixer, from the depth plans.

No model is built: the numbers come from each mixer's plan and the shared transport's
rules (what is live across the cut, minus what the receiving rank already caches).

    python tools/transport_bytes.py --model 1p5b --pp 4 --vp 2 --tp 2 --sp
"""

from __future__ import annotations

import argparse

from tabulate import tabulate


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="1p5b")
    p.add_argument("--mixers", default="all")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--vp", type=int, default=None)
    p.add_argument("--sp", action="store_true", help="sequence parallel")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--bytes-per-element", type=int, default=2, help="2 for bf16/fp16")
    p.add_argument("--option", action="append", default=[], help="e.g. depth_attn.stride=12")
    args = p.parse_args()

    from depthmix.config.load import compose_run
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.planning.pipeline import PipelineLayout, geometry_of
    from depthmix.mixers import available, get_mixer

    names = available() if args.mixers == "all" else args.mixers.split(",")
    print(f"model={args.model} tp={args.tp} pp={args.pp} vp={args.vp} sp={args.sp} "
          f"micro_batch={args.micro_batch} {args.bytes_per_element} B/element; MiB per "
          "micro-batch for each transition into chunk c (payload / wire)\n")
    vanilla_total, rows = None, []
    for name in ["vanilla", *[n for n in names if n != "vanilla"]]:
        overrides = [f"model={args.model}", f"mixer={name}", f"parallel.tp={args.tp}",
                     f"parallel.pp={args.pp}", f"parallel.sequence_parallel={args.sp}"]
        if args.vp:
            overrides.append(f"parallel.vp={args.vp}")
        overrides += [f"mixer.{o.split('.', 1)[1]}" for o in args.option
                      if o.startswith(name + ".")]
        run = compose_run(*overrides)
        config = to_transformer_config(run)
        layout = PipelineLayout(config.num_layers, args.pp, args.vp or 1)
        geo = geometry_of(get_mixer(name).plan, config, layout, args.tp)
        mib = 2**20
        cells, total = [], 0
        for c in range(1, layout.num_chunks):
            payload = geo.payload_bytes(c, args.micro_batch, args.bytes_per_element)
            wire = geo.wire_bytes(c, args.micro_batch, args.bytes_per_element)
            total += wire
            cells.append(f"{payload / mib:.1f}/{wire / mib:.1f}")
        vanilla_total = vanilla_total or total
        rows.append([name, f"x{total / vanilla_total:.2f}", *cells])
    chunks = [f"into chunk {c}" for c in range(1, len(rows[0]) - 1)]
    print(tabulate(rows, ["mixer", "wire / vanilla's", *chunks], tablefmt="plain", disable_numparse=True))


if __name__ == "__main__":
    main()
