"""jsonl / jsonl.zst text -> Megatron ``.bin/.idx`` token files (``depthmix-preprocess``:
:mod:`depthmix.cli.preprocess`).

    depthmix-preprocess --input 'pile/train/*.jsonl.zst' --tokenizer neox.json \\
        --output-prefix /data/pile/pile_train --workers 16

Every input line is a JSON object; its ``--json-key`` field (default ``text``) is one
document. Documents are tokenised with the ``tokenizers`` JSON file given by path, the
end-of-document id is appended to each, and they are written in input order (files sorted
by name, lines in file order) in Megatron-Core's ``IndexedDataset`` format (see
:mod:`depthmix.data.index_file`): one sequence per document, tokens as uint16 when the
vocabulary fits (else int32). Files are streamed
(``.zst`` and ``.gz`` decompressed on the fly), so memory does not grow with file size.

``--split-by KEY.PATH`` (e.g. ``meta.pile_set_name``) writes one prefix per value of that
field instead, ``PREFIX_<value>``, and a manifest ``PREFIX.manifest.json`` listing them.

Bad input stops the run with the file (and line) named: a compressed file that ends inside
a frame, a line that is not UTF-8 or not JSON, a missing field, or no documents at all.
The outputs appear atomically: everything is written under temporary names and renamed
only when the whole run succeeded, so a failed run leaves no ``.bin/.idx`` behind.

This module imports neither torch nor Megatron (the files are written by
:class:`TokenFileWriter`, not Megatron's ``IndexedDatasetBuilder``, whose import costs
seconds and whose per-document Python lists cost memory), so it starts quickly.
"""

from __future__ import annotations

import collections
import glob
import gzip
import io
import itertools
import json
import multiprocessing
import os
import re
import sys
import time
import zlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import numpy as np

from depthmix.data.index_file import TokenFileWriter, token_dtype

MAX_SPLITS = 1000
"""More distinct ``--split-by`` values than this is an error (a wrong key, most likely)."""


class InputError(ValueError):
    """Input that cannot be preprocessed; the message names the file (and line)."""


@dataclass
class SplitStats:
    """One output prefix: the ``--split-by`` value it holds (None without ``--split-by``)."""

    value: Optional[str]
    prefix: str = ""
    name: str = ""
    """The file-name form of ``value`` (:func:`split_name`): ``prefix`` ends with it."""
    documents: int = 0
    tokens: int = 0


@dataclass
class PreprocessStats:
    files: int = 0
    documents: int = 0
    tokens: int = 0
    empty_skipped: int = 0
    seconds: float = 0.0
    outputs: list[SplitStats] = field(default_factory=list)
    manifest: Optional[str] = None
    """``PREFIX.manifest.json`` with ``--split-by``."""


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


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a ``.zst`` file, frame after frame.

    zstandard's ``stream_reader`` reports a file cut inside a frame as a clean (early) end
    of data, so a truncated shard would silently lose its tail; this reader raises
    ``EOFError`` instead.
    """

    READ_BYTES = 1 << 18

    def __init__(self, path: str):
        import zstandard

        self._zstd = zstandard
        self._raw = open(path, "rb")
        # The Pile's shards were written with long-distance windows; allow them.
        self._dctx = zstandard.ZstdDecompressor(max_window_size=2**31)
        self._frame = None  # decompressobj of the frame being read
        self._unused = b""  # compressed bytes after the end of the last frame
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def _decompress_more(self) -> bool:
        data = self._unused or self._raw.read(self.READ_BYTES)
        self._unused = b""
        if not data:
            if self._frame is not None:
                raise EOFError("the file ends inside a zstd frame (truncated?)")
            return False
        if self._frame is None:
            self._frame = self._dctx.decompressobj()
        try:
            self._out = memoryview(self._frame.decompress(data))
        except self._zstd.ZstdError as e:
            raise EOFError(f"damaged zstd data ({e})") from None
        if self._frame.eof:
            self._unused, self._frame = self._frame.unused_data, None
        return True

    def readinto(self, buffer) -> int:
        while not len(self._out):
            if not self._decompress_more():
                return 0
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


def open_binary(path: str) -> io.BufferedIOBase:
    """A streaming binary reader of ``.jsonl``, ``.jsonl.zst`` and ``.jsonl.gz`` files;
    a compressed file that ends early raises ``EOFError``."""
    if path.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(path), buffer_size=1 << 20)
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _iter_lines(files: Sequence[str]) -> Iterator[tuple[str, int, bytes]]:
    """(file, line number, raw line) of every non-blank line, decompressed."""
    for path in files:
        lineno = 0
        try:
            with open_binary(path) as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield path, lineno, line
        except (EOFError, zlib.error, gzip.BadGzipFile) as e:
            raise InputError(f"{path}: truncated or damaged compressed file, after line "
                             f"{lineno} of its text: {e}") from None


def _chunks(it, size: int):
    while True:
        chunk = list(itertools.islice(it, size))
        if not chunk:
            return
        yield chunk


# ---------------------------------------------------------------- worker side
_WORKER: dict = {}


def _init_worker(tokenizer_path: str, json_key: str, in_pool: bool = True,
                 split_by: Optional[str] = None) -> None:
    if in_pool:
        # Each worker process tokenises sequentially; parallelism comes from the processes.
        # (In-process, ``encode_batch`` keeps its own threads.)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from depthmix.data.tokenizer import HFTokenizer

    _WORKER["tok"] = HFTokenizer(tokenizer_path)
    _WORKER["dtype"] = token_dtype(_WORKER["tok"].vocab_size)
    _WORKER["key"] = json_key
    _WORKER["split_by"] = split_by


def _split_value(record: dict, dotted: str, where: str) -> str:
    value = record
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            raise InputError(f"{where}: no {dotted!r} field (--split-by)")
        value = value[part]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise InputError(f"{where}: field {dotted!r} is {type(value).__name__}, not a string "
                         "(--split-by)")
    return str(value)


def _encode_chunk(chunk: list[tuple[str, int, bytes]]
                  ) -> list[tuple[Optional[str], Optional[np.ndarray]]]:
    """(split value, token array with EOD appended) per line; array None for an empty
    document; split value None without ``--split-by``."""
    tok, key, split_by = _WORKER["tok"], _WORKER["key"], _WORKER["split_by"]
    texts, values = [], []
    for path, lineno, raw in chunk:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InputError(f"{path}:{lineno}: not valid UTF-8 (byte {e.start + 1} of the "
                             f"line: {e.reason})") from None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{lineno}: not valid JSON ({e})") from None
        if not isinstance(record, dict) or key not in record:
            raise InputError(f"{path}:{lineno}: no {key!r} field (set --json-key)")
        text = record[key]
        if not isinstance(text, str):
            raise InputError(f"{path}:{lineno}: field {key!r} is {type(text).__name__}, "
                             "not a string")
        texts.append(text)
        values.append(_split_value(record, split_by, f"{path}:{lineno}") if split_by else None)
    out: list[tuple[Optional[str], Optional[np.ndarray]]] = []
    for value, ids in zip(values, tok.encode_batch(texts)):
        out.append((value, np.asarray(ids + [tok.eod], dtype=_WORKER["dtype"]) if ids else None))
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


def split_name(value: str) -> str:
    """A file-name-safe form of a ``--split-by`` value: ``Gutenberg (PG-19)`` ->
    ``Gutenberg_PG-19``, ``Wikipedia (en)`` -> ``Wikipedia_en``."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", value).strip("._")[:100]
    return name or "_"


def _split_names(values: Sequence[str]) -> dict[str, str]:
    """:func:`split_name` of each value; values whose names collide all get a hash suffix
    (so the names do not depend on the order the values were met in)."""
    import hashlib

    names = {v: split_name(v) for v in values}
    taken = collections.Counter(names.values())
    for v, name in names.items():
        if taken[name] > 1:
            names[v] = f"{name}-{hashlib.sha1(v.encode()).hexdigest()[:8]}"
    return names


class _Outputs:
    """One :class:`TokenFileWriter` per split value (a single one without ``--split-by``),
    each under a temporary name until :meth:`commit` renames them all."""

    def __init__(self, output_prefix: str, dtype: type, split_by: Optional[str]):
        self.output_prefix, self.dtype, self.split_by = output_prefix, dtype, split_by
        self._tmp = f"{output_prefix}.tmp{os.getpid()}"
        self.writers: dict[Optional[str], TokenFileWriter] = {}
        self.tmp_prefixes: dict[Optional[str], str] = {}
        self.stats: dict[Optional[str], SplitStats] = {}
        self.written: list[str] = []  # temporary files, for clean-up

    def add(self, value: Optional[str], array: np.ndarray) -> None:
        writer = self.writers.get(value)
        if writer is None:
            if len(self.writers) >= MAX_SPLITS:
                raise InputError(f"--split-by {self.split_by}: more than {MAX_SPLITS} distinct "
                                 "values; is it the right field?")
            tmp = self.tmp_prefixes[value] = f"{self._tmp}.{len(self.writers)}"
            self.written.append(tmp + ".bin")
            writer = self.writers[value] = TokenFileWriter(tmp + ".bin", self.dtype)
            self.stats[value] = SplitStats(value)
        writer.add_document(array)
        self.stats[value].documents += 1
        self.stats[value].tokens += array.size

    def commit(self) -> list[SplitStats]:
        """Finalize, flush to disk and rename every output; the stats, sorted by value."""
        if self.split_by is None:
            finals = {None: self.output_prefix}
        else:
            names = _split_names(list(self.writers))
            finals = {v: f"{self.output_prefix}_{names[v]}" for v in self.writers}
            for v, name in names.items():
                self.stats[v].name = name
        for value, writer in self.writers.items():
            self.written.append(self.tmp_prefixes[value] + ".idx")
            writer.finalize(self.tmp_prefixes[value] + ".idx")
        for path in self.written:
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        for value, tmp in self.tmp_prefixes.items():
            for suffix in (".bin", ".idx"):
                os.replace(tmp + suffix, finals[value] + suffix)
            self.stats[value].prefix = finals[value]
        self.written.clear()
        return sorted(self.stats.values(), key=lambda s: (s.value is not None, s.value or ""))

    def discard(self) -> None:
        for writer in self.writers.values():
            writer.close()
        for path in self.written:
            if os.path.exists(path):
                os.remove(path)


def _write_manifest(path: str, split_by: str, tokenizer: str, files: Sequence[str],
                    outputs: Sequence[SplitStats]) -> None:
    manifest = {
        "split_by": split_by,
        "tokenizer": os.path.abspath(tokenizer),
        "inputs": [os.path.abspath(f) for f in files],
        "documents": sum(s.documents for s in outputs),
        "tokens": sum(s.tokens for s in outputs),
        "datasets": {s.name: os.path.abspath(s.prefix) for s in outputs},
        "splits": [{"value": s.value, "name": s.name,
                    "prefix": os.path.abspath(s.prefix), "documents": s.documents,
                    "tokens": s.tokens} for s in outputs],
    }
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: str) -> dict[str, str]:
    """``{name: prefix}`` of a ``--split-by`` manifest (the form ``eval.datasets`` takes)."""
    with open(path, encoding="utf-8") as f:
        datasets = json.load(f)["datasets"]
    base = os.path.dirname(os.path.abspath(path))
    return {name: os.path.join(base, prefix) for name, prefix in datasets.items()}


def preprocess(inputs: Sequence[str], tokenizer: str, output_prefix: str, json_key: str = "text",
               workers: int = 1, chunk_size: int = 256, progress: bool = True,
               split_by: Optional[str] = None) -> PreprocessStats:
    """Tokenise ``inputs`` (paths/globs) into ``output_prefix.bin/.idx``; return counts.

    With ``split_by`` (a dotted JSON key path such as ``meta.pile_set_name``), one prefix
    ``output_prefix_<value>`` per value of that field, and ``output_prefix.manifest.json``.
    Raises :class:`InputError` (naming the file and line) on bad input or when no document
    is found; nothing is left on disk then.
    """
    from depthmix.data.tokenizer import HFTokenizer

    if not os.path.isfile(tokenizer):
        raise FileNotFoundError(f"--tokenizer {tokenizer!r}: no such file")
    if split_by is not None and not all(split_by.split(".")):
        raise InputError(f"--split-by {split_by!r} must be a dotted key path such as "
                         "meta.pile_set_name")
    files = expand_inputs(inputs)
    vocab_size = HFTokenizer(tokenizer).vocab_size
    dtype = token_dtype(vocab_size)

    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    stats = PreprocessStats(files=len(files))
    t0 = time.time()

    lines = _iter_lines(files)
    chunks = _chunks(lines, chunk_size)
    pool = None
    if workers > 1:
        ctx = multiprocessing.get_context("spawn")
        pool = ctx.Pool(workers, initializer=_init_worker,
                        initargs=(tokenizer, json_key, True, split_by))
        results = _bounded_imap(pool, _encode_chunk, chunks, max_pending=4 * workers)
    else:
        _init_worker(tokenizer, json_key, in_pool=False, split_by=split_by)
        results = map(_encode_chunk, chunks)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=f"tokenising {len(files)} file(s)", unit=" docs", dynamic_ncols=True,
                   mininterval=1.0, file=sys.stderr)
    outputs = _Outputs(output_prefix, dtype, split_by)
    try:
        for pairs in results:
            for value, array in pairs:
                if array is None:
                    stats.empty_skipped += 1
                    continue
                outputs.add(value, array)
                stats.documents += 1
                stats.tokens += array.size
            if bar is not None:
                bar.update(len(pairs))
                bar.set_postfix(tokens=f"{stats.tokens:,}", refresh=False)
        if stats.documents == 0:
            raise InputError(
                f"no documents in {', '.join(files)}: every line is blank or has an empty "
                f"{json_key!r} field ({stats.empty_skipped} empty); not writing an empty "
                "dataset")
        stats.outputs = outputs.commit()
        if split_by is not None:
            stats.manifest = f"{output_prefix}.manifest.json"
            _write_manifest(stats.manifest, split_by, tokenizer, files, stats.outputs)
    except BaseException:
        outputs.discard()
        raise
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _WORKER.clear()
        if bar is not None:
            bar.close()
    stats.seconds = time.time() - t0
    return stats
