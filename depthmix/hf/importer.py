"""A Hugging Face causal-LM folder -> a depthmix checkpoint, a model preset and the
tokenizer (``depthmix-import``: :mod:`depthmix.cli.importer`).

The output directory holds::

    checkpoints/                 a save directory: the tracker and iter_0000000/, one
                                 Megatron distributed checkpoint (weights only) with its
                                 depthmix.json (model record, health mark, checksums) and
                                 tokenizer.json; loadable at any TP/PP/VP/DP layout
    configs/model/<name>.yaml    the model preset (``hydra.searchpath=[file://<out>/configs]
                                 model=<name>``)
    tokenizer/                   the tokenizer files found in the source folder

:func:`prepare` does every check that reads only ``config.json`` and file names (no torch),
:func:`write` builds the model on one process, copies the weights in one layer at a time
and saves it through :func:`depthmix.checkpoint.distributed.save`. Everything is written
into ``<out>.partial`` and renamed at the end: a failed import leaves no ``<out>``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from depthmix import runtime
from depthmix.config.schema import ConfigError, ModelConfig
from depthmix.hf import architecture

log = logging.getLogger("depthmix")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")
"""What ``tokenizer/`` receives when the source folder has it; ``tokenizer.json`` (the
``tokenizers`` file our data pipeline and commands read) also goes into the checkpoint."""
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


@dataclass
class ImportJob:
    source: str
    """The Hugging Face folder."""
    hf_config: dict
    """Its ``config.json``."""
    model: ModelConfig
    precision: str
    """``train.precision`` recorded with the checkpoint: the dtype the weights are stored in."""
    weight_files: Dict[str, str]
    """Tensor name -> the safetensors file holding it."""
    tokenizer: Optional[str]
    """A ``tokenizers`` JSON file, or None."""
    out: str

    @property
    def checkpoints(self) -> str:
        """The save directory of a run whose output directory is ``out``."""
        from depthmix.checkpoint.store import default_save_dir

        return default_save_dir(run_config(self.model, self.precision, self.out))

    @property
    def preset(self) -> str:
        return os.path.join(self.out, "configs", "model", f"{self.model.name}.yaml")


def _read_json(path: str, option: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{option}: cannot read {path} ({e})") from None


def _weight_files(source: str) -> Tuple[Dict[str, str], Dict[str, tuple]]:
    """Tensor name -> its safetensors file, and -> its shape (read from the headers)."""
    from safetensors import safe_open

    index = os.path.join(source, WEIGHTS_INDEX)
    if os.path.isfile(index):
        mapping = _read_json(index, "hf_dir")["weight_map"]
        files = {name: os.path.join(source, file) for name, file in mapping.items()}
    elif os.path.isfile(os.path.join(source, WEIGHTS)):
        with safe_open(os.path.join(source, WEIGHTS), framework="numpy") as f:
            files = {name: os.path.join(source, WEIGHTS) for name in f.keys()}
    else:
        raise ConfigError(f"hf_dir={source} holds no {WEIGHTS} or {WEIGHTS_INDEX} (save the "
                          "model with save_pretrained, which writes safetensors)")
    shapes = {}
    for file in sorted(set(files.values())):
        with safe_open(file, framework="numpy") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return files, shapes


def prepare(source: str, out: str, name: Optional[str] = None,
            seq_length: Optional[int] = None, precision: Optional[str] = None,
            tokenizer: Optional[str] = None) -> ImportJob:
    """Every check that needs no torch, in order: the folder and its ``config.json``, the
    architecture (:func:`depthmix.hf.architecture.check_maps`), the options, the output
    directory, the tensor names, the tokenizer."""
    from depthmix.config.validate import validate
    from depthmix.hf.names import check_names

    if not os.path.isdir(source):
        raise ConfigError(f"hf_dir={source}: no such directory")
    cfg = _read_json(os.path.join(source, "config.json"), "hf_dir")
    name = name or architecture.preset_name(os.path.abspath(source))
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ConfigError(f"--name={name}: use lower-case letters, digits and _")
    if seq_length is not None and seq_length < 1:
        raise ConfigError(f"--seq-length={seq_length} must be >= 1")
    model = architecture.model_config(cfg, name, seq_length)
    dtype = cfg.get("dtype", cfg.get("torch_dtype")) or "float32"
    precision = precision or architecture.PRECISION_OF.get(dtype, "fp32")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"out_dir={out} exists and is not empty: choose a new directory")
    probe = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(probe):  # the nearest existing parent must let us create it
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"out_dir={out} cannot be created: {probe} is not a writable "
                          "directory")
    run = run_config(model, precision)
    validate(run)
    files, shapes = _weight_files(source)
    check_names(shapes, model)
    tokenizer = _tokenizer(source, tokenizer, model)
    return ImportJob(source=os.path.abspath(source), hf_config=cfg, model=model,
                     precision=precision, weight_files=files, tokenizer=tokenizer,
                     out=os.path.abspath(out))


def _tokenizer(source: str, given: Optional[str], model: ModelConfig) -> Optional[str]:
    from depthmix.data.tokenizer import load_tokenizer

    if given is not None:
        return load_tokenizer(given, "--tokenizer", model.vocab_size).path
    found = os.path.join(source, "tokenizer.json")
    if not os.path.isfile(found):
        log.warning("depthmix-import: %s has no tokenizer.json; importing the model without a "
                    "tokenizer (give --tokenizer FILE to add one)", source)
        return None
    return load_tokenizer(found, f"hf_dir={source}: tokenizer.json", model.vocab_size).path


def run_config(model: ModelConfig, precision: str, output_dir: str = "."):
    """A single-rank :class:`RunConfig` of the plain residual model (``mixer=vanilla``)."""
    from depthmix.config.schema import RunConfig
    from depthmix.mixers import get_mixer

    run = RunConfig(model=model)
    run.mixer = get_mixer("vanilla").config_cls(name="vanilla", impl="torch")  # no kernels
    run.mixer.resolve(run.model)
    run.train.precision = precision
    run.output_dir = output_dir
    return run


@runtime.entry_point
def write(job: ImportJob) -> str:
    """Build the model, copy the weights in, save the checkpoint, the preset and the
    tokenizer into ``job.out``; returns the checkpoint's path."""
    partial = f"{job.out}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    final_out, job.out = job.out, partial
    try:
        path = _write_checkpoint(job)
        _write_preset(job)
        _copy_tokenizer(job)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        job.out = final_out
    if os.path.isdir(final_out):  # prepare() allowed only an empty one
        os.rmdir(final_out)
    os.rename(partial, final_out)
    return os.path.join(final_out, os.path.relpath(path, partial))


def _write_checkpoint(job: ImportJob) -> str:
    import torch
    import torch.distributed as dist
    from safetensors import safe_open

    from depthmix.checkpoint.distributed import save
    from depthmix.hf.names import HF_EMBEDDING, HF_OUTPUT, is_packed
    from depthmix.hf.weights import from_hf
    from depthmix.megatron_ext.config import to_transformer_config
    from depthmix.megatron_ext.model import build_chunk
    from depthmix.mixers import mixer_of
    from depthmix.pretrain.parallelize import destroy_distributed, init_distributed

    run = run_config(job.model, job.precision)
    created = not dist.is_initialized()
    topo = init_distributed(run)
    try:
        config = to_transformer_config(run)
        config.perform_initialization = False  # every weight is overwritten below
        model = build_chunk(config, mixer_of(run))
        dtype = config.params_dtype
        model.to(dtype)  # as Float16Module does for bf16/fp16 training
        opened: Dict[str, object] = {}

        def get(name: str) -> torch.Tensor:
            file = job.weight_files[name]
            if file not in opened:
                opened[file] = safe_open(file, framework="pt")
            return opened[file].get_tensor(name)

        if job.model.tie_embeddings and HF_OUTPUT in job.weight_files and not torch.equal(
                get(HF_OUTPUT), get(HF_EMBEDDING)):
            raise ConfigError(f"tie_word_embeddings=true in config.json but {HF_OUTPUT} "
                              f"differs from {HF_EMBEDDING}")
        params = dict(model.named_parameters())
        with torch.no_grad():  # names and shapes were checked by prepare()
            for ours, tensor in from_hf(get, job.model, packed=is_packed(job.weight_files)):
                params[ours].copy_(tensor.to(dtype))
        opened.clear()
        size = sum(p.numel() * p.element_size() for p in params.values())
        return save(job.checkpoints, run=run, model=[model], optimizer=None, scheduler=None,
                    topo=topo, step=0, consumed_samples=0, keep_last=0, estimate=size,
                    health={"healthy": True, "confirmed": True}, tokenizer=job.tokenizer,
                    extra_meta={"contents": "weights", "imported_from": {
                        "path": job.source,
                        "architectures": job.hf_config.get("architectures"),
                        "model_type": job.hf_config.get("model_type")}})
    finally:
        if created:
            destroy_distributed()


def _write_preset(job: ImportJob) -> None:
    import yaml

    os.makedirs(os.path.dirname(job.preset), exist_ok=True)
    arch = (job.hf_config.get("architectures") or [job.hf_config.get("model_type")])[0]
    with open(job.preset, "w") as f:
        f.write(f"# Imported by depthmix-import from {job.source} ({arch}).\n"
                "defaults:\n  - model_schema\n  - _self_\n\n")
        yaml.safe_dump(dataclasses.asdict(job.model), f, sort_keys=False)


def _copy_tokenizer(job: ImportJob) -> List[str]:
    folder = os.path.join(job.out, "tokenizer")
    sources = [os.path.join(job.source, n) for n in TOKENIZER_FILES]
    if job.tokenizer is not None:
        sources[0] = job.tokenizer
    copied = [s for s in sources if os.path.isfile(s)]
    if copied:
        os.makedirs(folder)
    for path in copied:
        shutil.copyfile(path, os.path.join(folder, os.path.basename(path)))
    return copied


def usage(job: ImportJob, checkpoint: str) -> str:
    """What to run next, for the command's closing lines."""
    tok = os.path.join(job.out, "tokenizer", "tokenizer.json")
    data = f" data.tokenizer={tok} data.prefixes=[<prefix>]" if job.tokenizer else ""
    return "\n".join([
        f"checkpoint   {checkpoint}",
        f"model preset {job.preset}",
        *([f"tokenizer    {tok}"] if job.tokenizer else []),
        "evaluate:",
        f"  depthmix-eval eval.checkpoint={job.out} "
        "'eval.datasets={name: <prefix>}'",
        "continue pretraining with a depth mixer (weights only: fresh optimizer and step):",
        f"  depthmix-train 'hydra.searchpath=[file://{os.path.join(job.out, 'configs')}]' "
        f"model={job.model.name} mixer=attnres_block train.load_dir={job.out} "
        f"train.load_weights_only=true{data}",
    ])
