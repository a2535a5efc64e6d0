"""What a checkpoint is: the model record written beside every checkpoint.

``record(run)`` is stored in each checkpoint's ``depthmix.json``. It serves two readers:

* resume / fine-tune checks: :func:`mismatches` lists, per option, where the current run
  differs from the checkpoint in anything that must match to load it (architecture, mixer
  and its options, vocabulary, sequence length, precision);
* evaluation, generation and export: :func:`run_from_record` rebuilds the model and mixer
  configuration from the checkpoint alone, so those commands need no ``model=``/``mixer=``.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List

from depthmix.config.schema import ModelConfig, MoEConfig, RunConfig

RECORD_VERSION = 1

MODEL_FIELDS_FREE = ("name", "init_std")
"""Model options that may differ between a checkpoint and the run that loads it (a preset's
name is a label; the init std only matters before the first step)."""
MOE_FIELDS_FREE = ("experts_impl",)
"""Expert options that do not change the computation: sequential and grouped experts hold
the same parameters (``depthmix.megatron_ext.grouped_experts``)."""
MIXER_FIELDS_FREE = ("impl", "two_phase")
"""Mixer options that do not change the computation (a kernel choice, Block AttnRes'
two-phase inference reads)."""


def record(run: RunConfig) -> Dict[str, Any]:
    """The model/mixer configuration of ``run`` as plain JSON values (tuples become lists,
    as they do in the saved file, so a fresh record compares equal to a loaded one)."""
    return json.loads(json.dumps({
        "version": RECORD_VERSION,
        "model": dataclasses.asdict(run.model),
        "mixer": dataclasses.asdict(run.mixer),
        "precision": run.train.precision,
    }))


def fingerprint(rec: Dict[str, Any]) -> Dict[str, Any]:
    """Flat ``option -> value`` of everything that must match to load weights. A model
    option added after the record was written (e.g. ``tie_embeddings``) counts at its
    default, which is what that checkpoint was saved with."""
    model = {**dataclasses.asdict(ModelConfig()), **rec["model"]}
    moe = model.pop("moe") or {}
    out = {f"model.{k}": v for k, v in model.items() if k not in MODEL_FIELDS_FREE}
    # experts option by option; a dense model (null, or no experts) is num_experts 0 alone
    out.update({f"model.moe.{k}": v for k, v in moe.items() if k not in MOE_FIELDS_FREE}
               if moe.get("num_experts") else {"model.moe.num_experts": 0})
    out.update({f"mixer.{k}": v for k, v in rec["mixer"].items() if k not in MIXER_FIELDS_FREE})
    out["train.precision"] = rec["precision"]
    return out


def mismatches(saved: Dict[str, Any], run: RunConfig, ignore=("train.precision",)) -> List[str]:
    """One line per option whose value in ``run`` differs from the checkpoint record
    ``saved`` (``option: checkpoint X, this run Y``). ``ignore``: options allowed to differ
    (precision by default: loading fp32 weights into bf16 compute is legitimate; the
    trainer adds it back when the optimizer state is loaded too)."""
    a, b = fingerprint(saved), fingerprint(record(run))
    other_mixer = a.get("mixer.name") != b.get("mixer.name")
    out = []
    for key in sorted(set(a) | set(b)):
        if key in ignore:
            continue
        if other_mixer and key.startswith("mixer.") and (key not in a or key not in b):
            continue  # an option only one of the two mixers has: the name says it
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            out.append(f"{key}: checkpoint {a.get(key, '<absent>')!r}, "
                       f"this run {b.get(key, '<absent>')!r}")
    return out


def listed(lines: List[str]) -> str:
    """Mismatch lines for a message: one per line, indented."""
    return "".join(f"\n  {line}" for line in lines)


def run_from_record(rec: Dict[str, Any], **mixer_overrides) -> RunConfig:
    """A :class:`RunConfig` with the checkpoint's model, mixer and precision (everything
    else default: single rank, TP=PP=1). ``mixer_overrides`` e.g. ``impl="torch"``. The
    record names its mixer; the config resolves that name
    (:func:`~depthmix.config.load.saved_mixer`)."""
    from depthmix.config.load import resolve_experts_impl, saved_mixer

    known = {f.name for f in dataclasses.fields(ModelConfig)}
    model = {k: v for k, v in rec["model"].items() if k in known}
    if isinstance(model.get("moe"), dict):  # the experts' implementation: this machine's
        model["moe"] = MoEConfig(**{**model["moe"], "experts_impl": "auto"})
    run = RunConfig(model=ModelConfig(**model))
    run.mixer = saved_mixer(rec["mixer"], run.model, **mixer_overrides)
    run.train.precision = rec["precision"]
    resolve_experts_impl(run)
    return run
