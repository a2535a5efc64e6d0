"""A checkpoint -> one whole model in this process (TP=PP=1), for generation, lm-eval and export.

The checkpoint may have been saved at any TP/PP/VP/DP layout: tensor keys use global
layer indices and Megatron's distributed checkpointing reshards on load. The model and
mixer configuration come from the checkpoint's own record (``depthmix.json``), so the
caller needs nothing but the path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from depthmix.checkpoint.record import run_from_record
from depthmix.config.schema import ConfigError, RunConfig


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
        from depthmix.checkpoint.distributed import TOKENIZER

        path = os.path.join(self.path, TOKENIZER)
        return path if os.path.isfile(path) else None

    @property
    def vocab_size(self) -> int:
        """Real vocabulary (the embedding is padded beyond it)."""
        return self.run.model.vocab_size


def find_checkpoint(path: str, option: str = "checkpoint") -> str:
    """The complete checkpoint ``path`` names (a save dir -> its latest, or one ``iter_*``
    directory); a :class:`ConfigError` naming ``option`` when there is none."""
    from depthmix.checkpoint import distributed as ckpt

    if not path or not os.path.exists(path):
        raise ConfigError(f"{option}={path}: no such directory")
    found = ckpt.latest_checkpoint(path)
    if found is None:
        raise ConfigError(f"{option}={path} holds no complete checkpoint "
                          f"(no {ckpt.TRACKER} or {ckpt.META})")
    if "record" not in ckpt.read_meta(found):
        raise ConfigError(f"{option}={found} predates model records in checkpoints "
                          "(depthmix.json has no 'record'); re-save it with this version")
    return found


def load_model(path: str, impl: str = "torch", dtype: Optional[torch.dtype] = None,
               device: Optional[torch.device] = None, option: str = "checkpoint") -> LoadedModel:
    """Load the checkpoint at ``path`` into a single-rank model.

    ``impl``: the mixer's kernel choice (``torch``, ``triton`` or ``auto``). ``dtype``: cast
    the weights after loading (default: the training precision). Initialises a world of
    one process (gloo on CPU) when no process group exists; without CUDA that needs
    :func:`depthmix.runtime.install` (the entry points and the test harness call it).
    """
    from megatron.core import dist_checkpointing

    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.megatron_ext.model import DepthMixModel
    from depthmix.checkpoint import distributed as ckpt
    from depthmix.pretrain.parallelize import init_distributed

    found = find_checkpoint(path, option)
    meta = ckpt.read_meta(found)
    run = run_from_record(meta["record"], impl=impl)
    init_distributed(run)
    model = DepthMixModel(to_transformer_config(run))
    if device is not None:
        model.to(device)
    elif torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    with torch.no_grad():
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, found)
        model.load_state_dict(loaded["model"], strict=True)
    if dtype is not None:
        model.to(dtype)
    model.eval()
    return LoadedModel(model=model, run=run, path=found, meta=meta)
