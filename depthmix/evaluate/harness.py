"""lm-evaluation-harness adapter: a depthmix checkpoint (any mixer) as an lm-eval model.

``DepthmixLM`` implements lm-eval's three request types on one process (TP=PP=1, the
checkpoint may have been saved at any layout) with the checkpoint's own tokenizer:

* ``loglikelihood``: context + continuation, right-padded batches sorted longest first
  (as lm-eval's Hugging Face adapter does), one forward, the continuation's
  log-probabilities summed in fp32. Right padding needs no mask: causal attention never
  looks right and every depth read is at the token's own position, so a row's scores
  do not depend on its batch.
* ``loglikelihood_rolling``: lm-eval's disjoint rolling windows of ``max_length`` tokens,
  each window's first token conditioned on the end-of-document token (documents follow
  one in training).
* ``generate_until``: left-padded batches through :func:`~depthmix.inference.generate.generate`
  (KV cache, per-row positions and padding mask), stopped at EOS or a stop string.

Registered as lm-eval model ``depthmix``. lm-eval 0.4.13 discovers models only through its
own table (no plugin entry point), so ``lm_eval --model depthmix`` needs this module
imported: run ``python -m depthmix.evaluate.harness`` with lm_eval's usual arguments.
"""

from __future__ import annotations

import difflib
import logging
import os
import sys
from typing import List, Optional, Sequence, Tuple, Union

if __name__ == "__main__":
    # `python -m depthmix.evaluate.harness ...`: hand over to the importable module, whose
    # class is the one registered with lm-eval (this __main__ copy must not register too).
    from depthmix.evaluate.harness import main

    sys.exit(main())

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    Collator,
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
)
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from depthmix import runtime
from depthmix.config.schema import ConfigError
from depthmix.config.validate import PRECISIONS
from depthmix.data.tokenizer import HFTokenizer
from depthmix.runtime.precision import torch_dtype

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")
"""Task YAML shipped with depthmix (e.g. the ``depth_attn_table1`` group); always on the
include path of :func:`evaluate_tasks`."""


def _positive_int(value, option: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise ConfigError(f"{option}={value} must be a positive integer")
    return number


@register_model("depthmix")
class DepthmixLM(TemplateLM):
    """A depthmix model for lm-eval.

    Args:
        checkpoint: a save directory (its latest checkpoint), one ``iter_*`` directory or
            a training run's or an import's output directory; loaded with
            :func:`~depthmix.inference.load.load_model`.
        model: instead of ``checkpoint``, a :class:`~depthmix.inference.load.LoadedModel`
            or a ``(model, tokenizer)`` pair (tokenizer: an ``HFTokenizer`` or its path).
        tokenizer: a tokenizers JSON file (default: the checkpoint's ``tokenizer.json``).
        batch_size: sequences per forward.
        max_length: longest input in tokens (default: the model's ``seq_length``); longer
            contexts are cut from the left.
        max_gen_toks: default generation budget of ``generate_until``.
        impl / dtype / device: kernel choice (``torch``/``triton``/``auto``), weight dtype
            (``fp32``/``bf16``/``fp16``, default: training precision), device (default:
            CUDA when available) when loading ``checkpoint``.
        vocab_size: logits kept (default: the checkpoint's vocabulary; a ``(model,
            tokenizer)`` pair keeps all of the model's logits).
    """

    @runtime.entry_point
    def __init__(self, checkpoint: Optional[str] = None, model=None,
                 tokenizer: Union[None, str, HFTokenizer] = None, batch_size: Union[int, str] = 1,
                 max_length: Optional[int] = None, max_gen_toks: int = 256, impl: str = "auto",
                 dtype: Optional[str] = None, device: Optional[str] = None,
                 vocab_size: Optional[int] = None, max_batch_size=None, **unused):
        super().__init__()
        from depthmix.inference.load import LoadedModel, load_model

        if (checkpoint is None) == (model is None):
            raise ConfigError("DepthmixLM needs exactly one of checkpoint=<dir> or model=")
        if checkpoint is not None:
            if dtype is not None and dtype not in PRECISIONS:
                raise ConfigError(f"dtype={dtype} must be one of {sorted(PRECISIONS)}")
            model = load_model(str(checkpoint), impl=impl,
                               dtype=torch_dtype(dtype) if dtype else None,
                               device=torch.device(device) if device else None)
        self.checkpoint = None
        if isinstance(model, LoadedModel):
            self.checkpoint = model.path
            tokenizer = tokenizer or model.tokenizer_path
            if tokenizer is None:
                raise ConfigError(f"tokenizer= is needed: checkpoint {model.path} carries no "
                                  "tokenizer.json")
            vocab_size = vocab_size or model.vocab_size
            self.mixer = model.run.mixer.name
            model = model.model
        else:
            model, tokenizer = model
            self.mixer = model.config.mixer.name
        self.model = model.eval()
        self.tok = tokenizer if isinstance(tokenizer, HFTokenizer) else HFTokenizer(tokenizer)
        self.vocab_size = int(vocab_size or model.config.vocab_size)
        if self.tok.vocab_size > self.vocab_size:
            raise ConfigError(f"tokenizer={self.tok.path} has {self.tok.vocab_size} tokens, "
                              f"more than the model's vocabulary ({self.vocab_size})")
        if str(batch_size).startswith("auto"):
            raise ConfigError(f"batch_size={batch_size}: give a number (no automatic search)")
        self.batch_size = _positive_int(batch_size, "batch_size")
        self._max_length = _positive_int(max_length or model.config.seq_length, "max_length")
        self.max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks")
        self._device = next(model.parameters()).device

    # ---- what TemplateLM asks for -------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tok.eod

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tok.path

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None, **kwargs) -> List[int]:
        ids = self.tok.encode(string)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tok.decode(list(tokens))

    def _encode_pair(self, context: str, continuation: str) -> Tuple[List[int], List[int]]:
        """lm-eval's causal split, exactly: the context's own tokens, and as continuation
        the whole text's tokens past as many (``"...went to sl"`` + ``"ept"``: ``t`` is
        scored after the context's ``Ġs``, ``l``, not after the whole text's ``Ġsle``,
        ``p``). Only where that continuation is empty (``"...went to sl"`` + ``"eep"`` ->
        one token ``sleep``: lm-eval's ``hf`` model asserts, aborting the evaluation) does
        the whole text's last token become the continuation, after the tokens before it."""
        context_enc, continuation_enc = super()._encode_pair(context, continuation)
        if continuation_enc:
            return context_enc, continuation_enc
        whole = self.tok_encode(context + continuation)
        if not whole:
            raise ValueError(f"the loglikelihood request (context {context!r}, continuation "
                             f"{continuation!r}) tokenizes to nothing")
        return whole[:-1] or [self.prefix_token_id], whole[-1:]

    def get_model_info(self) -> dict:
        return {"depthmix_checkpoint": self.checkpoint, "depthmix_mixer": self.mixer}

    @torch.no_grad()
    def _model_logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` -> fp32 log-probabilities ``[b, s, vocab]``."""
        logits = self.model(input_ids.to(self._device))[..., : self.vocab_size]
        return F.log_softmax(logits.float(), dim=-1)

    # ---- loglikelihood ------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> List[Tuple[float, bool]]:
        """``requests``: ``((context, continuation) or None, context ids, continuation ids)``."""

        def longest_first(req):
            tokens = req[1] + req[2]
            return -len(tokens), tuple(tokens)

        order = Collator(requests, sort_fn=longest_first)
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="depthmix loglikelihood")
        for chunk in order.get_batched(n=self.batch_size):
            inputs, spans = [], []
            for request, context, continuation in chunk:
                if not continuation:
                    raise ValueError(f"the loglikelihood request {request!r} has an empty "
                                     "continuation")
                # the last max_length + 1 tokens; the final one is only ever a target
                whole = (context + continuation)[-(self.max_length + 1):]
                inputs.append(whole[:-1])
                spans.append((len(whole) - 1, continuation[-len(whole) + 1:]))
            width = max(len(x) for x in inputs)
            batch = torch.full((len(inputs), width), self.tok.pad, dtype=torch.long)
            for row, x in enumerate(inputs):
                batch[row, : len(x)] = torch.tensor(x, dtype=torch.long)  # right padding
            logprobs = self._model_logprobs(batch)
            for (request, _, _), row_lp, (length, targets) in zip(chunk, logprobs, spans):
                target = torch.tensor(targets, dtype=torch.long, device=row_lp.device)
                scored = row_lp[length - len(targets): length]  # [n, vocab]
                answer = (float(scored.gather(-1, target[:, None]).sum()),
                          bool((scored.argmax(-1) == target).all()))
                results.append(answer)
                if request is not None:
                    self.cache_hook.add_partial("loglikelihood", request, answer)
                bar.update(1)
        bar.close()
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> List[float]:
        windows, owners = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for context, target in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, target))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, scores):
            totals[index] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generate_until -----------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> List[str]:
        from depthmix.inference.generate import generate, left_pad

        order = Collator([req.args for req in requests],
                         sort_fn=lambda req: (-len(self.tok_encode(req[0])), req[0]),
                         group_by="gen_kwargs", group_fn=lambda req: req[1])
        eos_text = self.tok.decode([self.eot_token_id])
        results = []
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0,
                   desc="depthmix generate_until")
        for chunk in order.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            if max_new >= self.max_length:
                raise ValueError(f"max_gen_toks={max_new} leaves no room for a context in "
                                 f"max_length={self.max_length}")
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") \
                else 0.0
            prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_new)
                       or [self.eot_token_id] for c in contexts]
            input_ids, mask = left_pad(prompts, self.tok.pad, self._device)
            texts = [[] for _ in prompts]

            def stop_strings(token, done, texts=texts):
                for row, t in enumerate(token.tolist()):
                    texts[row].append(t)
                return torch.tensor([any(s in self.tok.decode(ids) for s in until if s)
                                     for ids in texts])

            out = generate(self.model, input_ids, max_new, temperature=temperature,
                           top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"),
                           eos_id=self.eot_token_id, vocab_size=self.vocab_size,
                           attention_mask=mask, on_token=stop_strings)
            for (context, gen_kwargs), row in zip(chunk, out[:, input_ids.shape[1]:].tolist()):
                if self.eot_token_id in row:
                    row = row[: row.index(self.eot_token_id)]
                text = postprocess_generated_text(self.tok.decode(row), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                bar.update(1)
        bar.close()
        return order.get_original(results)


# ---------------------------------------------------------------------------------------
# Running tasks
# ---------------------------------------------------------------------------------------


def task_manager(include_path=None, include_defaults: bool = True):
    """lm-eval's ``TaskManager`` over its own tasks (unless ``include_defaults=False``),
    depthmix's shipped groups and ``include_path`` (a folder or a list of folders)."""
    from lm_eval.tasks import TaskManager

    paths = [TASKS_DIR]
    if include_path:
        paths += list(include_path) if isinstance(include_path, (list, tuple)) else [include_path]
    return TaskManager(include_path=[str(p) for p in paths], include_defaults=include_defaults)


def check_task_names(manager, tasks: Sequence[str], option: str = "eval.tasks") -> None:
    """A :class:`ConfigError` naming every unknown task with its closest known names."""
    known = manager.all_tasks
    unknown = [t for t in tasks if isinstance(t, str) and not manager.match_tasks([t])]
    if unknown:
        hints = []
        for name in unknown:
            close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
            hints.append(f"{name!r} (did you mean: {', '.join(close)}?)" if close
                         else f"{name!r} (no close match)")
        raise ConfigError(f"{option}: unknown lm-eval task {'; '.join(hints)}; "
                          "`lm_eval ls tasks` lists them all")


@runtime.entry_point
def evaluate_tasks(loaded, tasks: Sequence[str], num_fewshot: Optional[int] = None,
                   batch_size: int = 1, limit: Optional[float] = None, include_path=None,
                   include_defaults: bool = True, **simple_evaluate_kwargs) -> dict:
    """Run lm-eval's ``simple_evaluate`` on ``tasks`` with this model; returns its results
    dict (``results[task][metric]``, ``configs``, ``n-shot``, ...).

    ``loaded``: a :class:`~depthmix.inference.load.LoadedModel`, a ``(model, tokenizer)``
    pair or a :class:`DepthmixLM`. ``include_path``: extra task YAML folders (the shipped
    ``depthmix/evaluate/tasks`` is always included). ``include_defaults=False`` skips
    indexing lm-eval's own ~15k task files (local tasks only; faster). Other keyword
    arguments go to ``simple_evaluate`` (e.g. ``log_samples=True``, ``random_seed``).
    Serialise the result with ``json.dumps(..., default=lm_eval.utils.handle_non_serializable)``.
    """
    from lm_eval import simple_evaluate

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-stage info lines are noise
    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    if not tasks:
        raise ConfigError("eval.tasks is empty: name at least one lm-eval task or group")
    manager = task_manager(include_path, include_defaults)
    check_task_names(manager, tasks)
    lm = loaded if isinstance(loaded, DepthmixLM) else DepthmixLM(model=loaded,
                                                                   batch_size=batch_size)
    lm.batch_size = _positive_int(batch_size, "eval.batch_size")
    simple_evaluate_kwargs.setdefault("log_samples", False)  # per-document records: large
    return simple_evaluate(model=lm, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                           task_manager=manager, **simple_evaluate_kwargs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """lm_eval's own command line with the ``depthmix`` model registered and the shipped
    task groups on the include path: ``python -m depthmix.evaluate.harness --model depthmix
    --model_args checkpoint=DIR --tasks depth_attn_table1_0shot``."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in argv and any(a.startswith("--tasks") for a in argv):
        argv += ["--include_path", TASKS_DIR]
    sys.argv = ["lm_eval", *argv]
    with runtime.installed():  # this process's entry point: the CPU shim, ...
        cli_evaluate()
    return 0
