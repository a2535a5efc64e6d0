"""``depthmix-import``: a Hugging Face causal-LM folder (Qwen3, Llama) -> a depthmix
checkpoint loadable at any layout, a model preset and the tokenizer
(:mod:`depthmix.hf.importer`).

    depthmix-import hf/Qwen3-0.6B imported/qwen3_0p6b

Every check that reads only ``config.json`` and file names runs before torch is imported,
so a mistake is reported at once.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from depthmix.cli.command import (
    argument_parser,
    command,
    quiet_libraries,
    require_path,
    require_writable_dir,
)
from depthmix.config.validate import PRECISIONS

PROG = "depthmix-import"


def build_parser() -> argparse.ArgumentParser:
    p = argument_parser(
        PROG, "Import a Hugging Face causal-LM folder (safetensors + config.json + tokenizer; "
              "Qwen3, Qwen3-MoE, or Llama-family without RoPE scaling, tied embeddings or not) "
              "as a depthmix checkpoint loadable at any TP/PP/VP/DP layout, with a model "
              "preset and the tokenizer. Architectures that do not map (biases, RoPE scaling, "
              "sliding windows, experts outside Qwen3-MoE) are refused, naming the "
              "config.json field.",
        f"example: {PROG} hf/Qwen3-0.6B imported/qwen3_0p6b, then "
        "depthmix-eval eval.checkpoint=imported/qwen3_0p6b/checkpoints ... (the command "
        "prints the next commands; docs/checkpoints.md)")
    p.add_argument("hf_dir", help="the Hugging Face model folder (config.json, "
                                  "model.safetensors or its index, tokenizer.json)")
    p.add_argument("out_dir", help="new (or empty) directory for checkpoints/, "
                                   "configs/model/<name>.yaml and tokenizer/")
    p.add_argument("--name", default=None,
                   help="model preset name (default: from the folder name, e.g. Qwen3-0.6B "
                        "-> qwen3_0p6b)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="model.seq_length of the preset (default: max_position_embeddings)")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="dtype the weights are stored in and train.precision of the record "
                        "(default: config.json's dtype)")
    p.add_argument("--tokenizer", default=None,
                   help="a tokenizers JSON file to use instead of the folder's tokenizer.json")
    return p


@command(input_errors=(OSError,), prog=PROG)
def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    require_path(args.hf_dir, "hf_dir", "dir")
    if args.tokenizer:
        require_path(args.tokenizer, "--tokenizer")
    require_writable_dir(args.out_dir, "out_dir")
    from depthmix.hf.importer import prepare, usage, write

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    job = prepare(args.hf_dir, args.out_dir, args.name, args.seq_length, args.precision,
                  args.tokenizer)
    with quiet_libraries():
        checkpoint = write(job)
    print(f"imported {job.source} -> {job.out}\n{usage(job, checkpoint)}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
