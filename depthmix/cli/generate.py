"""``depthmix-generate``: text from a checkpoint on one process, with the KV cache
(:func:`depthmix.inference.generate.generate`).

    depthmix-generate outputs/.../checkpoints -p 'Once upon a time' -n 40 --temperature 0.8

torch is imported inside the functions so that ``depthmix-generate --help`` and a wrong
option or path are answered at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional, Sequence

from depthmix.cli.command import (
    argument_parser,
    command,
    quiet_libraries,
    require_checkpoint,
    require_path,
)
from depthmix.config.schema import ConfigError
from depthmix.config.validate import PRECISIONS
from depthmix.runtime import exit_codes

PROG = "depthmix-generate"


def build_parser() -> argparse.ArgumentParser:
    p = argument_parser(
        PROG, "Generate text from a depthmix checkpoint (any mixer, saved at any TP/PP "
              "layout) on one process, with the KV cache.",
        f"example: {PROG} outputs/.../checkpoints -p 'Once upon a time' -n 40 "
        "--temperature 0.8 --top-p 0.95")
    p.add_argument("checkpoint", help="a save directory (its latest checkpoint), one "
                                      "iter_* checkpoint directory, or a training run's or "
                                      "an import's output directory")
    p.add_argument("-p", "--prompt", action="append", default=[],
                   help="a prompt (repeatable; with --prompts-file too: these come first)")
    p.add_argument("-f", "--prompts-file",
                   help="prompts one per line; a .jsonl file holds per line a JSON string or "
                        "an object with a 'prompt' (or 'text') field")
    p.add_argument("--tokenizer", help="a Hugging Face tokenizers JSON file (default: the "
                                       "checkpoint's tokenizer.json)")
    p.add_argument("-n", "--max-new-tokens", type=int, default=64,
                   help="tokens to generate per prompt at most (default 64)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-k", type=int, help="sample among the k most likely tokens")
    p.add_argument("--top-p", type=float,
                   help="sample from the smallest set of tokens with this probability mass")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed (default 0); every prompt's generator starts from it, "
                        "so a prompt samples the same text in any batch")
    p.add_argument("--eos", type=int,
                   help="end-of-sequence token id (default: the tokenizer's end-of-document)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the end-of-sequence token")
    p.add_argument("--bos", action="store_true",
                   help="start each prompt with the end-of-document token (a fresh document, "
                        "as documents follow one in training)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="prompts decoded together (left-padded; default 8)")
    p.add_argument("--impl", choices=("torch", "triton", "auto"), default="auto",
                   help="mixer kernels: PyTorch, Triton, or Triton on CUDA (default auto)")
    p.add_argument("--dtype", choices=PRECISIONS, help="weights and activations (default: the "
                                                   "training precision)")
    p.add_argument("--format", choices=("text", "jsonl"), default="text",
                   help="text: prompt and continuation (one prompt streams token by token, "
                        "a batch prints each prompt when it is done); jsonl: one JSON object "
                        "per prompt with the token ids")
    return p


def read_prompts(args) -> List[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
        if args.prompts_file.endswith(".jsonl"):
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if isinstance(item, dict):
                    item = item.get("prompt", item.get("text"))
                if not isinstance(item, str):
                    raise ValueError(f"--prompts-file={args.prompts_file} line {number}: "
                                     "expected a string or an object with 'prompt' or 'text'")
                prompts.append(item)
        else:
            prompts.extend(line for line in lines if line)
    return prompts


def _check_args(args, parser) -> None:
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if args.batch_size < 1:
        parser.error(f"--batch-size={args.batch_size} must be >= 1")
    if args.temperature < 0:
        parser.error(f"--temperature={args.temperature} must be >= 0")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top-k={args.top_k} must be >= 1")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        parser.error(f"--top-p={args.top_p} must be in (0, 1]")
    if not args.prompt and not args.prompts_file:
        parser.error("give at least one --prompt or a --prompts-file")


class _Printer:
    """Writes finished rows in input order as soon as they and all earlier rows are done;
    a lone prompt in text format streams its continuation token by token."""

    def __init__(self, tokenizer, prompts: List[str], prompt_ids: List[List[int]], eos,
                 fmt: str, stream: bool):
        self.tok, self.prompts, self.prompt_ids = tokenizer, prompts, prompt_ids
        self.eos, self.fmt, self.stream = eos, fmt, stream
        self.tokens: List[List[int]] = [[] for _ in prompts]
        self.ended = [False] * len(prompts)
        self.printed, self.shown = 0, ""
        if stream:
            sys.stdout.write(prompts[0])
            sys.stdout.flush()

    def update(self, first: int, token, done) -> None:
        """One step of the batch whose rows start at ``first``."""
        for row, (t, d) in enumerate(zip(token.tolist(), done.tolist()), start=first):
            if self.ended[row]:
                continue
            if self.eos is not None and t == self.eos:
                self.ended[row] = True
                continue
            self.tokens[row].append(t)
            self.ended[row] = bool(d)
        if self.stream and not self.ended[0]:
            text = self.tok.decode(self.tokens[0])
            if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
                sys.stdout.write(text[len(self.shown):])
                sys.stdout.flush()
                self.shown = text
        while self.printed < len(self.prompts) and self.ended[self.printed]:
            self._emit(self.printed)

    def finish(self, upto: int) -> None:
        """Rows before ``upto`` are complete (their batch ended): print them."""
        while self.printed < upto:
            self._emit(self.printed)

    def _emit(self, row: int) -> None:
        completion = self.tok.decode(self.tokens[row])
        if self.fmt == "jsonl":
            stopped = "eos" if self.ended[row] else "length"
            print(json.dumps({"prompt": self.prompts[row], "completion": completion,
                              "prompt_tokens": self.prompt_ids[row],
                              "tokens": self.tokens[row], "stop": stopped}), flush=True)
        elif self.stream:
            print(completion[len(self.shown):], flush=True)
        else:
            print(self.prompts[row] + completion + "\n", flush=True)
        self.printed += 1


def run(args) -> int:
    import torch

    from depthmix.data.tokenizer import HFTokenizer
    from depthmix.inference.generate import generate, left_pad
    from depthmix.inference.load import load_model
    from depthmix.runtime.precision import torch_dtype

    prompts = read_prompts(args)
    if not prompts:
        raise ConfigError(f"--prompts-file={args.prompts_file} holds no prompt")
    dtype = torch_dtype(args.dtype) if args.dtype else None
    loaded = load_model(args.checkpoint, impl=args.impl, dtype=dtype)
    tokenizer_path = args.tokenizer or loaded.tokenizer_path
    if tokenizer_path is None:
        raise ConfigError(f"--tokenizer is needed: checkpoint {loaded.path} carries no "
                          "tokenizer.json (its run had no tokenizer file)")
    try:
        tokenizer = HFTokenizer(tokenizer_path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"--tokenizer={tokenizer_path}: {e}") from None
    if tokenizer.vocab_size > loaded.vocab_size:
        raise ConfigError(f"--tokenizer={tokenizer_path} has {tokenizer.vocab_size} tokens, "
                          f"more than the model's vocabulary ({loaded.vocab_size})")
    eos = None if args.ignore_eos else (args.eos if args.eos is not None else tokenizer.eod)
    prefix = [tokenizer.eod] if args.bos else []
    ids = [prefix + tokenizer.encode(p) for p in prompts]
    if any(not p for p in ids):
        raise ConfigError("an empty prompt has no token to continue from; use --bos")
    longest = max(len(p) for p in ids) + args.max_new_tokens
    if longest > loaded.run.model.seq_length:
        print(f"{PROG}: warning: prompt + --max-new-tokens reaches {longest} "
              f"tokens, beyond the {loaded.run.model.seq_length} the model was trained on",
              file=sys.stderr)
    device = next(loaded.model.parameters()).device
    printer = _Printer(tokenizer, prompts, ids, eos, args.format,
                       stream=args.format == "text" and len(prompts) == 1)
    for start in range(0, len(prompts), args.batch_size):
        batch = ids[start:start + args.batch_size]
        input_ids, mask = left_pad(batch, tokenizer.pad, device)
        generators = [torch.Generator(device=device).manual_seed(args.seed) for _ in batch]

        def on_token(token, done, first=start):
            printer.update(first, token, done)

        generate(loaded.model, input_ids, args.max_new_tokens, args.temperature, args.top_k,
                 eos, loaded.vocab_size, generators, top_p=args.top_p, attention_mask=mask,
                 on_token=on_token)
        printer.finish(start + len(batch))
    return exit_codes.OK


@command(input_errors=(OSError, ValueError), prog=PROG)
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(args, parser)
    require_checkpoint(args.checkpoint, "checkpoint")
    for option, path in (("--tokenizer", args.tokenizer), ("--prompts-file", args.prompts_file)):
        if path:
            require_path(path, option)
    with quiet_libraries():
        return run(args)


if __name__ == "__main__":
    sys.exit(main())
