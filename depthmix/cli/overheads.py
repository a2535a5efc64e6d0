"""``depthmix-overheads``: the Depth-Attention paper's Table 2 for every mixer, from our hooks
(:mod:`depthmix.planning.overheads`).

    depthmix-overheads model=3b
    depthmix-overheads model=1p5b parallel.pp=4 --prefill 131072 --mixers depth_attn,mhc

Options (``model=...``, ``mixer.<option>`` for a single mixer, ``parallel.pp=...``) are
Hydra overrides of the training config.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from depthmix.cli.command import argument_parser, closest_name, command, compose_run
from depthmix.config.schema import ConfigError
from depthmix.planning import overheads as table


@command
def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argument_parser("depthmix-overheads", f"{__doc__}\n{table.__doc__}")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=3b parallel.pp=4")
    parser.add_argument("--mixers", default="all", help="comma-separated (default: every mixer)")
    parser.add_argument("--prefill", type=int, default=131072,
                        help="prefill length for the state column (default 128K tokens)")
    parser.add_argument("--bytes", type=int, default=2, dest="element_size",
                        help="bytes per activation element (default 2: fp16/bf16)")
    args = parser.parse_args(argv)

    from depthmix.mixers import available, get_mixer

    names = available() if args.mixers == "all" else args.mixers.split(",")
    for name in names:
        if name not in available():
            raise ConfigError(f"--mixers: {name} is not a mixer; choose among "
                              f"{', '.join(available())}{closest_name(name, available())}")
    overrides = list(args.overrides)
    if not any(o.startswith(("parallel.pp=", "parallel=")) for o in overrides):
        overrides.append("parallel.pp=4")
    runs = [compose_run(*overrides, f"mixer={name}") for name in names]
    rows = [table.overheads(run, get_mixer(name), args.prefill, args.element_size)
            for run, name in zip(runs, names)]
    model = next((o for o in overrides if o.startswith("model=")), "model=tiny")
    print(f"extra cost over the vanilla decoder, {model}, {args.element_size}-byte activations; "
          f"FLOPs forward (2 per multiply-add); pipeline bytes per micro-batch of one sequence")
    if runs and runs[0].model.experts:
        print(table.experts_note(runs[0], get_mixer("vanilla")))
    print(table.table(rows, args.prefill))


if __name__ == "__main__":
    sys.exit(main())
