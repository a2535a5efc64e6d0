"""``depthmix-preprocess``: jsonl / jsonl.zst / jsonl.gz documents -> Megatron ``.bin/.idx``
token files (:func:`depthmix.data.preprocess.preprocess`); imports neither torch nor Megatron.

    depthmix-preprocess --input 'pile/train/*.jsonl.zst' --tokenizer neox.json \\
        --output-prefix /data/pile/pile_train --workers 16
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from depthmix.cli.command import argument_parser, command, require_path, require_writable_dir
from depthmix.config.schema import ConfigError
from depthmix.data.preprocess import preprocess

PROG = "depthmix-preprocess"


def build_parser() -> argparse.ArgumentParser:
    p = argument_parser(
        PROG, "Tokenise jsonl / jsonl.zst / jsonl.gz documents into Megatron .bin/.idx files "
              "(one document per line, end-of-document token appended).")
    p.add_argument("--input", "-i", nargs="+", required=True,
                   help="input files or globs (quote globs), e.g. 'pile/train/*.jsonl.zst'")
    p.add_argument("--tokenizer", "-t", required=True,
                   help="a Hugging Face tokenizers JSON file (e.g. the GPT-NeoX tokenizer.json)")
    p.add_argument("--output-prefix", "-o", required=True,
                   help="writes PREFIX.bin and PREFIX.idx (use PREFIX in data.prefixes)")
    p.add_argument("--json-key", default="text", help="the field holding the text (default text)")
    p.add_argument("--workers", "-j", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="tokeniser processes (default: CPU count - 1)")
    p.add_argument("--chunk-size", type=int, default=256,
                   help="documents per work item sent to a worker (default 256)")
    p.add_argument("--split-by", metavar="KEY.PATH",
                   help="write one prefix per value of this JSON field (a dotted path, e.g. "
                        "meta.pile_set_name for the Pile's domains): PREFIX_<value>.bin/.idx "
                        "and PREFIX.manifest.json listing value -> prefix, documents, tokens")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress display")
    return p


@command(input_errors=(FileNotFoundError, ValueError), prog=PROG)
def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    if args.workers < 1 or args.chunk_size < 1:
        raise ConfigError("--workers and --chunk-size must be >= 1")
    for pattern in args.input:
        require_path(pattern, "--input", "glob")
    require_path(args.tokenizer, "--tokenizer")
    require_writable_dir(os.path.dirname(os.path.abspath(args.output_prefix)), "--output-prefix")
    stats = preprocess(args.input, args.tokenizer, args.output_prefix, args.json_key,
                       args.workers, args.chunk_size, progress=not args.no_progress,
                       split_by=args.split_by)
    skipped = f" ({stats.empty_skipped} empty documents skipped)" if stats.empty_skipped else ""
    if stats.manifest is None:
        print(f"wrote {args.output_prefix}.bin/.idx: {stats.documents:,} documents, "
              f"{stats.tokens:,} tokens from {stats.files} file(s) in {stats.seconds:.1f} s"
              + skipped)
        return
    for s in stats.outputs:
        print(f"  {s.value:<24} {s.documents:>12,} documents {s.tokens:>16,} tokens  "
              f"{s.prefix}.bin/.idx")
    print(f"wrote {len(stats.outputs)} prefixes (one per {args.split_by}) and {stats.manifest}: "
          f"{stats.documents:,} documents, {stats.tokens:,} tokens from {stats.files} file(s) "
          f"in {stats.seconds:.1f} s" + skipped)


if __name__ == "__main__":
    sys.exit(main())
