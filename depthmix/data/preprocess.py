"""``depthmix-preprocess``: jsonl / jsonl.zst text -> Megatron ``.bin/.idx`` token files.

    depthmix-preprocess --input 'pile/train/*.jsonl.zst' --tokenizer neox.json \\
        --output-prefix /data/pile/pile_train --workers 16

Every input line is a JSON object; its ``--json-key`` field (default ``text``) is one
document. Documents are tokenised with the ``tokenizers`` JSON file given by path, the
end-of-document id is appended to each, and they are written in input order (files sorted
by name, lines in file order) with Megatron's ``IndexedDatasetBuilder``: one sequence per
document, tokens as uint16 when the vocabulary fits (else int32). Files are streamed
(``.zst`` and ``.gz`` decompressed on the fly), so memory does not grow with file size.
The outputs appear atomically: ``PREFIX.bin`` and ``PREFIX.idx`` are written under
temporary names and renamed when complete.

This module imports neither torch nor Megatron at the top level, so worker processes
start quickly.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import io
import itertools
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np


@dataclass
class PreprocessStats:
    files: int = 0
    documents: int = 0
    tokens: int = 0
    empty_skipped: int = 0
    seconds: float = 0.0


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Files named by ``patterns`` (paths or globs), each glob sorted; missing ones raise."""
    files: list[str] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matched = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matched:
                raise FileNotFoundError(f"--input {pattern!r} matches no files")
            files.extend(matched)
        elif os.path.isfile(pattern):
            files.append(pattern)
        else:
            raise FileNotFoundError(f"--input {pattern!r}: no such file")
    return files


def open_text(path: str) -> io.TextIOBase:
    """A streaming text reader for ``.jsonl``, ``.jsonl.zst`` and ``.jsonl.gz`` files."""
    if path.endswith(".zst"):
        import zstandard

        raw = open(path, "rb")
        # The Pile's shards were written with long-distance windows; allow them.
        reader = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(
            raw, closefd=True)
        return io.TextIOWrapper(reader, encoding="utf-8")
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _iter_lines(files: Sequence[str]) -> Iterator[tuple[str, int, str]]:
    for path in files:
        with open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield path, lineno, line


def _chunks(it, size: int):
    while True:
        chunk = list(itertools.islice(it, size))
        if not chunk:
            return
        yield chunk


# ---------------------------------------------------------------- worker side
_WORKER: dict = {}


def _init_worker(tokenizer_path: str, json_key: str, in_pool: bool = True) -> None:
    if in_pool:
        # Each worker process tokenises sequentially; parallelism comes from the processes.
        # (In-process, ``encode_batch`` keeps its own threads.)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from depthmix.data.tokenizer import HFTokenizer

    _WORKER["tok"] = HFTokenizer(tokenizer_path)
    _WORKER["key"] = json_key


def _encode_chunk(chunk: list[tuple[str, int, str]]) -> list[Optional[np.ndarray]]:
    """Token arrays (EOD appended) for a chunk of lines; None for an empty document."""
    tok, key = _WORKER["tok"], _WORKER["key"]
    texts = []
    for path, lineno, line in chunk:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
        if not isinstance(record, dict) or key not in record:
            raise ValueError(f"{path}:{lineno}: no {key!r} field (set --json-key)")
        text = record[key]
        if not isinstance(text, str):
            raise ValueError(f"{path}:{lineno}: field {key!r} is {type(text).__name__}, "
                             "not a string")
        texts.append(text)
    out: list[Optional[np.ndarray]] = []
    for ids in tok.encode_batch(texts):
        if not ids:
            out.append(None)
        else:
            out.append(np.asarray(ids + [tok.eod], dtype=np.int64))
    return out


# ---------------------------------------------------------------- main side
def _bounded_imap(pool, fn, items, max_pending: int):
    """Ordered ``pool.imap`` that keeps at most ``max_pending`` items in flight.

    ``Pool.imap`` consumes its input as fast as it can, which would read a whole
    multi-gigabyte shard into memory; this reads ahead only ``max_pending`` chunks.
    """
    pending: collections.deque = collections.deque()
    for item in items:
        pending.append(pool.apply_async(fn, (item,)))
        if len(pending) >= max_pending:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits (vocab <= 65536), else int32 (as Megatron reads them)."""
    return np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32


def preprocess(inputs: Sequence[str], tokenizer: str, output_prefix: str, json_key: str = "text",
               workers: int = 1, chunk_size: int = 256, progress: bool = True
               ) -> PreprocessStats:
    """Tokenise ``inputs`` (paths/globs) into ``output_prefix.bin/.idx``; return counts."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from depthmix.data.tokenizer import HFTokenizer

    if not os.path.isfile(tokenizer):
        raise FileNotFoundError(f"--tokenizer {tokenizer!r}: no such file")
    files = expand_inputs(inputs)
    vocab_size = HFTokenizer(tokenizer).vocab_size
    dtype = token_dtype(vocab_size)

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    tmp_prefix = f"{output_prefix}.tmp{os.getpid()}"
    stats = PreprocessStats(files=len(files))
    t0 = time.time()

    lines = _iter_lines(files)
    chunks = _chunks(lines, chunk_size)
    pool = None
    if workers > 1:
        ctx = multiprocessing.get_context("spawn")
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer, json_key))
        results = _bounded_imap(pool, _encode_chunk, chunks, max_pending=4 * workers)
    else:
        _init_worker(tokenizer, json_key, in_pool=False)
        results = map(_encode_chunk, chunks)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=f"tokenising {len(files)} file(s)", unit=" docs", dynamic_ncols=True,
                   mininterval=1.0, file=sys.stderr)
    builder = IndexedDatasetBuilder(f"{tmp_prefix}.bin", dtype=dtype)
    try:
        for arrays in results:
            for array in arrays:
                if array is None:
                    stats.empty_skipped += 1
                    continue
                builder.add_document(array, [array.size])
                stats.documents += 1
                stats.tokens += array.size
            if bar is not None:
                bar.update(len(arrays))
                bar.set_postfix(tokens=f"{stats.tokens:,}", refresh=False)
        builder.finalize(f"{tmp_prefix}.idx")
    except BaseException:
        builder.data_file.close()
        for suffix in (".bin", ".idx"):
            if os.path.exists(tmp_prefix + suffix):
                os.remove(tmp_prefix + suffix)
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _WORKER.clear()
        if bar is not None:
            bar.close()
    os.replace(f"{tmp_prefix}.bin", f"{output_prefix}.bin")
    os.replace(f"{tmp_prefix}.idx", f"{output_prefix}.idx")
    stats.seconds = time.time() - t0
    return stats


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="depthmix-preprocess",
        description="Tokenise jsonl / jsonl.zst / jsonl.gz documents into Megatron .bin/.idx "
                    "files (one document per line, end-of-document token appended).")
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
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress display")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1 or args.chunk_size < 1:
        print("depthmix-preprocess: --workers and --chunk-size must be >= 1", file=sys.stderr)
        return 2
    try:
        stats = preprocess(args.input, args.tokenizer, args.output_prefix, args.json_key,
                           args.workers, args.chunk_size, progress=not args.no_progress)
    except (FileNotFoundError, ValueError) as e:
        print(f"depthmix-preprocess: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output_prefix}.bin/.idx: {stats.documents:,} documents, "
          f"{stats.tokens:,} tokens from {stats.files} file(s) in {stats.seconds:.1f} s"
          + (f" ({stats.empty_skipped} empty documents skipped)" if stats.empty_skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
