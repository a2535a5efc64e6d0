"""A checkpoint -> one whole model in this process (TP=PP=1), for generation, lm-eval and export:
the bare ``DepthMixModel``, no training wrapper, no random initialisation before the load.

The checkpoint may have been saved at any TP/PP/VP/DP layout: tensor keys use global
layer indices and Megatron's distributed checkpointing reshards on load. The model and
mixer configuration come from the checkpoint's own record (``depthmix.json``), so the
caller needs nothing but the path. Experts are loaded dropless whatever capacity they were
trained with (as Hugging Face's MoE models run): every token reaches its top-k experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from depthmix import runtime
from depthmix.checkpoint.record import run_from_record
from depthmix.checkpoint.store import find_checkpoint, read_meta, tokenizer_file
from depthmix.config.schema import RunConfig


@dataclass
class LoadedModel:
    model: torch.nn.Module
    """The bare ``DepthMixModel`` in eval mode: ``model(input_ids, inference=cache)``."""
    run: RunConfig
    """Model, mixer and precision of the checkpoint (single-rank layout)."""
    path: str
    """The ``iter_*`` directory loaded."""
    meta: dict
    """The checkpoint's ``depthmix.json``."""

    @property
    def tokenizer_path(self) -> Optional[str]:
        """The run's tokenizer saved with the checkpoint, or None (runs on synthetic data)."""
        return tokenizer_file(self.path)

    @property
    def vocab_size(self) -> int:
        """Real vocabulary (the embedding is padded beyond it)."""
        return self.run.model.vocab_size


@runtime.entry_point
def load_model(path: str, impl: str = "torch", dtype: Optional[torch.dtype] = None,
               device: Optional[torch.device] = None, option: str = "checkpoint") -> LoadedModel:
    """Load the checkpoint at ``path`` into a single-rank model.

    ``path``: one ``iter_*`` directory, a save directory (its latest checkpoint) or the
    output directory of a training run or of ``depthmix-import``. ``impl``: the mixer's
    kernel choice (``torch``, ``triton`` or ``auto``). ``dtype``: cast the weights after
    loading (default: the training precision). Initialises a world of one process (gloo on
    CPU) when no process group exists, and installs :mod:`depthmix.runtime` (the CPU shim,
    ...) unless it is installed (:func:`depthmix.runtime.entry_point`).
    """
    from depthmix.checkpoint.distributed import load_whole_model
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.megatron_ext.model import build_chunk
    from depthmix.mixers import mixer_of
    from depthmix.pretrain.parallelize import init_distributed

    found = find_checkpoint(path, option)
    meta = read_meta(found)
    run = run_from_record(meta["record"], impl=impl)
    if run.model.experts is not None and not run.model.experts.dropless:
        # every token reaches its experts: a capacity counts the tokens of one forward, so a
        # cached decoding step (one token) would drop otherwise than the whole sequence
        run.model.moe = dataclasses.replace(run.model.moe, dropless=True, capacity_factor=None)
    init_distributed(run)
    config = to_transformer_config(run)
    config.perform_initialization = False  # every weight comes from the checkpoint
    model = build_chunk(config, mixer_of(run))
    if device is not None:
        model.to(device)
    elif torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    load_whole_model(found, model)
    if dtype is not None:
        model.to(dtype)
    model.eval()
    return LoadedModel(model=model, run=run, path=found, meta=meta)
