"""From the composed Hydra config to one evaluation job, with every check before compute.

The model and mixer come from the checkpoint's record (``depthmix.json``), so
``depthmix-eval`` needs no ``model=``/``mixer=``. Options of those groups that *are* given on
the command line are assertions about the checkpoint and must agree with it:

* ``model=<preset>``: every option of the preset (an architecture) except its name;
* ``mixer=<name>``: the mixer's name (its other options come from the checkpoint);
* ``model.<option>=...``, ``mixer.<option>=...``: that option.

Any disagreement refuses the job with one line naming each option. ``train.precision``
defaults to the checkpoint's and may be changed (e.g. fp32 weights evaluated in bf16);
``mixer.impl`` (a kernel choice) defaults to ``auto``. :func:`run_job` evaluates the job.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import List, Sequence

from omegaconf import DictConfig, OmegaConf

from depthmix.checkpoint.record import listed, mismatches, run_from_record
from depthmix.config.schema import ConfigError, EvalConfig, RunConfig
from depthmix.evaluate.windows import TokenStream, num_windows


@dataclass
class Dataset:
    name: str
    prefix: str
    stream: TokenStream
    windows: int
    """Windows to evaluate (all of them, or ``eval.max_windows``)."""
    seq_length: int

    @property
    def predicted_tokens(self) -> int:
        return min(len(self.stream) - 1, self.windows * self.seq_length)


@dataclass
class EvalJob:
    run: RunConfig
    """Model, mixer (and by default precision) of the checkpoint; layout, logger, ... of
    the command line."""
    eval: EvalConfig
    checkpoint: str
    """The ``iter_*`` directory evaluated."""
    meta: dict
    """Its ``depthmix.json``."""
    datasets: List[Dataset]
    output: str
    """Where the results JSON goes."""
    world_size: int

    @property
    def num_microbatches(self) -> int:
        """Per step and DP rank: one per pipeline stage keeps the pipeline full."""
        return self.run.parallel.pp


def given_options(overrides: Sequence[str]) -> set:
    """Keys set on the command line (``model``, ``mixer.stride``, ...), prefixes stripped."""
    keys = set()
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        keys.add(key.split("@", 1)[0])
    return keys


def _requested(record: dict, composed: RunConfig, given: set) -> RunConfig:
    """The model/mixer the command line asserts: the checkpoint's, with what was given."""
    model = dict(record["model"])
    if "model" in given:
        model = dataclasses.asdict(composed.model)
    for key in given:
        if key.startswith("model."):
            name = key[6:].split(".")[0]  # model.moe.<x>: the whole model.moe as composed
            model[name] = getattr(composed.model, name)
    mixer = dict(record["mixer"])
    if "mixer" in given and composed.mixer.name != mixer["name"]:
        mixer = dataclasses.asdict(composed.mixer)
    for key in given:
        if key.startswith("mixer.") and key != "mixer.impl":
            mixer[key[6:]] = getattr(composed.mixer, key[6:])
    return run_from_record({"model": model, "mixer": mixer, "precision": record["precision"]},
                           impl="torch")


def check_matches(record: dict, composed: RunConfig, given: set, path: str) -> None:
    lines = mismatches(record, _requested(record, composed, given))
    if not lines:
        return
    raise ConfigError(
        f"eval.checkpoint={path} does not match the options given (the model and mixer come "
        f"from the checkpoint; drop the options or pick another checkpoint):{listed(lines)}")


def _check_eval_options(ev: EvalConfig, run: RunConfig, world_size: int) -> None:
    if ev.batch_size < 1:
        raise ConfigError(f"eval.batch_size={ev.batch_size} must be >= 1")
    if ev.max_windows is not None and ev.max_windows < 1:
        raise ConfigError(f"eval.max_windows={ev.max_windows} must be >= 1 (or null for all)")
    if ev.num_fewshot is not None and ev.num_fewshot < 0:
        raise ConfigError(f"eval.num_fewshot={ev.num_fewshot} must be >= 0")
    if ev.limit is not None and ev.limit <= 0:
        raise ConfigError(f"eval.limit={ev.limit} must be > 0")
    if ev.datasets is not None and not (isinstance(ev.datasets, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in ev.datasets.items())):
        raise ConfigError(f"eval.datasets={ev.datasets!r} must map names to data prefixes: "
                          "eval.datasets={name: /path/prefix, ...}")
    if not ev.datasets and not ev.tasks:
        raise ConfigError("nothing to evaluate: give eval.datasets={name: /path/prefix, ...} "
                          "and/or eval.tasks=[task, ...]")
    if ev.tasks:
        p = run.parallel
        if world_size != 1 or p.tp != 1 or p.pp != 1:
            raise ConfigError(
                f"eval.tasks runs in a single process (parallel.tp=1, parallel.pp=1, one "
                f"process); this job has {world_size} process(es) with parallel.tp={p.tp}, "
                f"parallel.pp={p.pp}: evaluate the tasks in a separate single-process run")
        harness()


def harness():
    """``depthmix.evaluate.harness.evaluate_tasks`` (the lm-eval adapter), imported lazily."""
    try:
        from depthmix.evaluate.harness import evaluate_tasks
    except ImportError as e:
        raise ConfigError(f"eval.tasks needs the lm-eval adapter depthmix.evaluate.harness, "
                          f"which cannot be imported here ({e}); install lm-eval "
                          "(pip install -e '.[dev]') or drop eval.tasks") from None
    return evaluate_tasks


def _datasets(ev: EvalConfig, run: RunConfig) -> List[Dataset]:
    out = []
    s, vocab = run.model.seq_length, run.model.vocab_size
    for name, prefix in (ev.datasets or {}).items():
        option = f"eval.datasets.{name}"
        stream = TokenStream(os.path.expanduser(prefix), option)
        if len(stream) < s + 1:
            raise ConfigError(
                f"{option}={prefix} has {len(stream)} tokens, fewer than one window "
                f"(model.seq_length + 1 = {s + 1} tokens)")
        top = stream.max_token()
        if top >= vocab:
            raise ConfigError(
                f"{option}={prefix} holds token id {top} >= model.vocab_size={vocab} of the "
                "checkpoint: it was tokenised with another vocabulary")
        windows = num_windows(len(stream), s)
        if ev.max_windows is not None:
            windows = min(windows, ev.max_windows)
        out.append(Dataset(name, prefix, stream, windows, s))
    return out


def _output_path(ev: EvalConfig, checkpoint: str) -> str:
    path = ev.output or os.path.join(checkpoint, "eval", f"{ev.name}.json")
    option = "eval.output" if ev.output else "eval.name"
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{option}: cannot create {directory} for the results ({e})") from None
    if not os.access(directory, os.W_OK):
        raise ConfigError(f"{option}: {directory} is not writable; set eval.output=<path>")
    return path


def prepare(cfg: DictConfig, overrides: Sequence[str], world_size: int = 1) -> EvalJob:
    """Every check that can fail, in order: the checkpoint exists and holds a record, the
    options given agree with it, the eval options and layout are valid, each dataset exists,
    spans one window and fits the vocabulary, the output is writable."""
    from depthmix.config.load import resolve
    from depthmix.config.validate import validate
    from depthmix.checkpoint.store import find_checkpoint, read_meta

    composed = resolve(cfg)
    ev: EvalConfig = OmegaConf.to_object(cfg.eval)
    if not ev.checkpoint:
        raise ConfigError("eval.checkpoint is required: a train.save_dir or one iter_* "
                          "checkpoint directory")
    path = find_checkpoint(ev.checkpoint, "eval.checkpoint")
    meta = read_meta(path)
    record = meta["record"]
    given = given_options(overrides)
    check_matches(record, composed, given, path)

    impl = composed.mixer.impl if "mixer.impl" in given else "auto"
    run = run_from_record(record, impl=impl)
    run.parallel, run.data, run.logger = composed.parallel, composed.data, composed.logger
    run.output_dir = composed.output_dir
    precision = composed.train.precision if "train.precision" in given else record["precision"]
    run.train = dataclasses.replace(composed.train, precision=precision)
    _check_eval_options(ev, run, world_size)
    dp = world_size // (run.parallel.tp * run.parallel.pp)
    run.train.micro_batch_size = ev.batch_size
    run.train.global_batch_size = ev.batch_size * max(dp, 1) * run.parallel.pp
    validate(run, world_size)
    datasets = _datasets(ev, run)
    return EvalJob(run=run, eval=ev, checkpoint=path, meta=meta, datasets=datasets,
                   output=_output_path(ev, path), world_size=world_size)


def compose_job(*overrides: str, world_size: int = 1) -> EvalJob:
    """:func:`prepare` for command-line style overrides (tests, tools)."""
    from hydra import compose, initialize_config_module

    from depthmix.config.store import register_configs
    from depthmix.runtime.env import register_resolvers

    register_configs()
    register_resolvers()
    with initialize_config_module("depthmix.configs", version_base=None):
        cfg = compose("evaluate", overrides=["output_dir=.", *overrides])
    return prepare(cfg, overrides, world_size)


def run_job(job: EvalJob) -> dict:
    """Evaluate ``job``; collective. Rank 0 writes the JSON, prints the table and logs to
    W&B; every rank returns the results."""
    import torch.distributed as dist

    from depthmix.evaluate import report
    from depthmix.evaluate.perplexity import evaluate_datasets

    start = time.perf_counter()
    tasks = None
    if job.eval.tasks:  # first: an unknown task fails before the perplexity pass
        from depthmix.inference.load import load_model
        from depthmix.runtime.precision import torch_dtype

        ev = job.eval
        loaded = load_model(job.checkpoint, impl=job.run.mixer.impl, option="eval.checkpoint",
                            dtype=torch_dtype(job.run.train.precision))
        tasks = harness()(loaded, list(ev.tasks), ev.num_fewshot, ev.batch_size, ev.limit,
                          include_path=ev.include_path)
        ran_in = str(next(loaded.model.parameters()).dtype).replace("torch.", "")
        del loaded
    datasets = evaluate_datasets(job) if job.datasets else []
    results = report.results_dict(job, datasets, tasks, time.perf_counter() - start)
    if tasks is not None:
        results["tasks_dtype"] = ran_in  # the weights' dtype the tasks ran in
    if dist.get_rank() == 0:
        report.write_json(job.output, results)
        if tasks:
            from lm_eval.utils import make_table

            print(make_table(tasks), flush=True)
        if datasets:
            print(report.table(datasets), flush=True)
        print(f"results written to {job.output}", flush=True)
        wandb_line = report.log_wandb(job, results)
        if wandb_line:
            print(wandb_line, flush=True)
    return results
