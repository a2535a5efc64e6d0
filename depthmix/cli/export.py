"""``depthmix-export``: a checkpoint -> a Hugging Face ``transformers`` model directory
(:func:`depthmix.export.hf.export`)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from depthmix.cli.command import (
    argument_parser,
    command,
    quiet_libraries,
    require_checkpoint,
    require_path,
    require_writable_dir,
)
from depthmix.config.validate import PRECISIONS


def build_parser() -> argparse.ArgumentParser:
    p = argument_parser(
        "depthmix-export", "Export a depthmix checkpoint (vanilla or depth_attn, with or "
                           "without experts, any TP/PP layout) to a Hugging Face "
                           "transformers model directory.")
    p.add_argument("checkpoint", help="a save directory (its latest checkpoint), one iter_* "
                                      "dir, or a training run's or an import's output dir")
    p.add_argument("out_dir", help="directory to write config.json, model.safetensors, "
                                   "tokenizer files (and remote code for depth_attn or a "
                                   "router Qwen3-MoE lacks)")
    p.add_argument("--dtype", choices=PRECISIONS, default=None,
                   help="weights dtype (default: the training precision)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizers JSON file (default: the one saved with the checkpoint)")
    return p


@command
def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    require_checkpoint(args.checkpoint, "checkpoint")
    require_writable_dir(args.out_dir, "out_dir")
    if args.tokenizer:
        require_path(args.tokenizer, "--tokenizer")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with quiet_libraries():
        from depthmix.export.hf import export

        out = export(args.checkpoint, args.out_dir, args.dtype, args.tokenizer)
    print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
    sys.exit(main())
