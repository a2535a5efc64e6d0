"""What a run prints and where it lands, in process: the start-up warning summary, the
console/train.log stream, the step line's fields (quiet on every rank but the logging one)
and the progress bar, the closing summary's resume command, ``run.name`` directories and
the profiler trace."""

import json
import logging
import os
import warnings

import pytest

from depthmix.runtime import log as run_log
from depthmix.pretrain.callbacks.summary import (
    directory_option,
    launch_command,
    resume_command,
)

MEGATRON_FILE = "/venv/lib/python3.11/site-packages/megatron/core/optimizer/__init__.py"


def _warn_from(filename, message, category=UserWarning):
    warnings.warn_explicit(message, category, filename, 24, module="megatron.core.optimizer")


def _shown():
    """Warnings as the console would show them (set inside ``catch_warnings``)."""
    shown = []
    warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
    warnings.simplefilter("default")
    return shown


def test_library_warnings_become_one_line_and_stay_quiet():
    with warnings.catch_warnings():  # restores filters and showwarning afterwards
        shown = _shown()
        collector = run_log.LibraryWarnings().start()
        _warn_from(MEGATRON_FILE, "Transformer Engine and Apex are not installed. "
                                  "Falling back to Torch optimizers.")
        _warn_from(MEGATRON_FILE.replace("optimizer/__init__", "models/backends"),
                   "Apex is not installed. Falling back to Torch Norm")
        _warn_from(MEGATRON_FILE, "full scope is deprecated.")
        warnings.warn_explicit("our own warning", UserWarning, "/repo/depthmix/x.py", 1)
        assert shown == ["our own warning"]  # ours pass through, the libraries' are held
        line = collector.finish()
        assert line == ("fused kernels: Transformer Engine and Apex not installed, using "
                        "PyTorch paths; 1 more library notice held back (train.verbose=true "
                        "shows it)")
        # a lazily imported module's fallback notice after start-up: still quiet
        _warn_from(MEGATRON_FILE.replace("optimizer/__init__", "clip_grads"),
                   "Transformer Engine and Apex are not installed. Falling back to local "
                   "implementations of multi_tensor_applier")
        # the first steps' notices of a multi-rank run: torch's deprecated collectives
        # (called from Megatron's gathers), Megatron's sequence-parallel advice
        warnings.warn_explicit("`torch.distributed.reduce_scatter_tensor` is deprecated. "
                               "Please use `torch.distributed.reduce_scatter_single` instead.",
                               FutureWarning, "/site-packages/torch/distributed/c10d_logger.py",
                               83)
        _warn_from(MEGATRON_FILE.replace("optimizer/__init__", "tensor_parallel/layers"),
                   "When using sequence parallelism it is recommended to set the environment "
                   "variable CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup")
        _warn_from(MEGATRON_FILE, "something new")
        assert shown == ["our own warning", "something new"]
        assert collector.finish() is None  # reported once


def test_verbose_shows_every_held_warning():
    with warnings.catch_warnings():
        shown = _shown()
        collector = run_log.LibraryWarnings().start()
        _warn_from(MEGATRON_FILE, "Apex is not installed. Falling back to Torch Norm")
        assert shown == []
        assert collector.finish(verbose=True) is None
        assert shown == ["Apex is not installed. Falling back to Torch Norm"]


def test_console_lines_reach_the_console_and_the_log_file(tmp_path, capsys):
    """The handlers of configs/hydra/job_logging/depthmix.yaml: bare lines on the console
    (warnings prefixed), the same lines stamped in the file."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    console = run_log.ConsoleHandler(stream=__import__("sys").stdout)
    console.setFormatter(run_log.ConsoleFormatter("%(message)s"))
    file = logging.FileHandler(tmp_path / "train.log")
    file.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    root.handlers[:] = [console, file]
    root.setLevel(logging.INFO)
    try:
        run_log.say("step      1/4 | loss 7.6475")
        logging.getLogger("depthmix").warning("LR schedule differs")
    finally:
        root.handlers[:], root.level = saved
        file.close()
    out = capsys.readouterr().out.splitlines()
    assert out == ["step      1/4 | loss 7.6475", "warning: LR schedule differs"]
    logged = (tmp_path / "train.log").read_text()
    assert "[depthmix.console][INFO] - step      1/4 | loss 7.6475" in logged
    assert "[depthmix][WARNING] - LR schedule differs" in logged


def test_megatron_info_is_hidden_unless_verbose():
    megatron = logging.getLogger("megatron.core.optimizer")
    saved = logging.getLogger("megatron").level, logging.getLogger("wandb").level
    try:
        run_log.quiet_libraries(verbose=False)
        assert not megatron.isEnabledFor(logging.INFO)
        assert megatron.isEnabledFor(logging.WARNING)
    finally:
        logging.getLogger("megatron").setLevel(saved[0])
        logging.getLogger("wandb").setLevel(saved[1])


def test_launch_command_as_typed():
    assert launch_command(["/venv/bin/depthmix-train", "model=tiny", "hydra.output_subdir=null"],
                          env={}) == ["depthmix-train", "model=tiny"]
    assert launch_command(["/repo/depthmix/cli/train.py", "model=tiny"], env={}) == \
        ["python", "-m", "depthmix.cli.train", "model=tiny"]
    agent = ["/venv/bin/python3", "/venv/bin/torchrun", "--nproc-per-node", "2", "-m",
             "depthmix.cli.train", "parallel=pp2"]
    assert launch_command(["/repo/depthmix/cli/train.py", "parallel=pp2"],
                          env={"TORCHELASTIC_RUN_ID": "x"}, parent_cmdline=agent) == \
        ["torchrun", "--nproc-per-node", "2", "-m", "depthmix.cli.train", "parallel=pp2"]


def test_resume_command_names_the_directory(tmp_path):
    cwd = str(tmp_path)
    out = os.path.join(cwd, "outputs", "local", "2026-11-24_01-10-03", "tiny_vanilla")
    cmd = ["depthmix-train", "model=tiny"]
    assert resume_command(out, cmd, cwd=cwd) == \
        "depthmix-train model=tiny run.name=local/2026-11-24_01-10-03/tiny_vanilla"
    assert resume_command(out, [*cmd, "run.name=x"], cwd=cwd) == \
        "depthmix-train model=tiny run.name=x"
    assert resume_command("/scratch/run 1", cmd, cwd=cwd) == \
        "depthmix-train model=tiny 'hydra.run.dir=/scratch/run 1'"
    sweep_job = os.path.join(cwd, "multirun", "local", "2026-11-24_01-10-03", "0_train.lr=0.001")
    assert directory_option(sweep_job, multirun=True, cwd=cwd) == \
        "run.name=local/2026-11-24_01-10-03"


def _hydra_dirs(*overrides):
    from hydra import compose, initialize_config_module

    from depthmix.config.store import register_configs
    from depthmix.runtime.env import register_resolvers

    register_configs()
    register_resolvers()
    with initialize_config_module("depthmix.configs", version_base=None):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    return cfg.hydra.run.dir, cfg.hydra.sweep.dir, cfg.run.name


def test_run_name_fixes_the_output_directory(monkeypatch):
    """The option the closing summary prints lands in the unnamed run's directory; a named
    run always lands in outputs/<name> (multirun: multirun/<name>)."""
    monkeypatch.setenv("DEPTHMIX_RUN_KEY", "local/2026-11-24_01-10-03")
    run_dir, sweep_dir, name = _hydra_dirs("model=tiny")
    assert (run_dir, name) == ("outputs/local/2026-11-24_01-10-03/tiny_vanilla", None)
    assert sweep_dir == "multirun/local/2026-11-24_01-10-03"
    option = directory_option(os.path.abspath(run_dir))
    assert _hydra_dirs("model=tiny", option)[0] == run_dir
    monkeypatch.setenv("DEPTHMIX_RUN_KEY", "local/another-time")
    assert _hydra_dirs("model=tiny", "run.name=x")[:2] == ("outputs/x", "multirun/x")


def test_profiler_writes_a_chrome_trace(megatron_single, tmp_path):
    from run_harness import make_run

    from depthmix.config.schema import ConfigError
    from depthmix.pretrain.callbacks import ProfilerCallback
    from depthmix.config.validate import validate
    from depthmix.pretrain.trainer import Trainer
    from depthmix.testing import SyntheticData

    run = make_run(steps=3)
    run.output_dir = str(tmp_path)
    run.train.profile_steps = [2, 3]
    trainer = Trainer(run, data=SyntheticData, callbacks=[ProfilerCallback()])
    trainer.train()
    trainer.close()
    path = tmp_path / "profile" / "trace_steps2-3_rank0.json"
    events = json.loads(path.read_text())["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("depthmix step"))
    assert steps == ["depthmix step 2", "depthmix step 3"]  # not step 1
    assert sum(e.get("name", "").startswith("aten::mm") for e in events) > 10, len(events)

    for bad in ([0, 2], [3, 2], [1]):
        run.train.profile_steps = bad
        with pytest.raises(ConfigError, match="train.profile_steps"):
            validate(run, 1)


def test_closing_summary_says_how_the_run_ended(tmp_path, monkeypatch):
    import types

    from depthmix.pretrain.callbacks import RunSummary

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    out = tmp_path / "outputs" / "local" / "t0" / "tiny_vanilla"
    (out / "checkpoints").mkdir(parents=True)
    (out / "train.log").write_text("")
    run = types.SimpleNamespace(output_dir=str(out), train=types.SimpleNamespace(steps=10),
                                logger=types.SimpleNamespace(mode="disabled"))
    trainer = types.SimpleNamespace(run=run, step=4, stop_reason=None, callbacks=[],
                                    state=types.SimpleNamespace(save_dir=str(out / "x")),
                                    last=types.SimpleNamespace(loss=2.5),
                                    topo=types.SimpleNamespace(is_logging_rank=True))

    def lines(error=None, **state):
        summary = RunSummary()
        summary.post_eval(trainer, types.SimpleNamespace(loss=2.75))
        for key, value in state.items():
            setattr(trainer, key, value)
        if error is not None:
            summary.on_error(trainer, error)
        return summary.lines(trainer)

    stopped = lines()
    assert stopped[0].startswith("run stopped (train.exit_after_steps) at step 4/10 | train loss "
                                 "2.5000 | eval loss 2.7500 | wall ")
    assert stopped[1:3] == ["outputs: outputs/local/t0/tiny_vanilla (train.log, checkpoints)",
                            "last checkpoint: none"]
    assert stopped[3].startswith("resume: ") and stopped[3].endswith(
        " run.name=local/t0/tiny_vanilla")
    assert lines(stop_reason="preempted (SIGTERM)")[0].startswith("run preempted (SIGTERM) at")
    failed = lines(error=RuntimeError("CUDA out of memory\nmore"))
    assert failed[0].startswith("run stopped on error (RuntimeError: CUDA out of memory) at")
    assert failed[-1].startswith("resume: ")
    finished = lines(step=10, stop_reason=None)
    assert finished[0].startswith("run finished at step 10/10")
    assert not [line for line in finished if line.startswith("resume:")]


def _fake_trainer(logging_rank: bool):
    import types

    from depthmix.testing import tiny_run

    run = tiny_run()
    run.train.log_interval, run.train.steps = 2, 10
    from depthmix.planning.flops import ThroughputMeter

    trainer = types.SimpleNamespace(
        run=run, config=None, step=0, meter=ThroughputMeter(6e9, 10.0, 1000, world_size=2),
        topo=types.SimpleNamespace(world_size=2, is_logging_rank=logging_rank))
    return trainer


def _step(trainer, callbacks):
    import types

    from depthmix.pretrain.trainer import Trainer

    trainer.step += 1
    trainer.meter.add(0.25)
    result = types.SimpleNamespace(loss=2.5, lr=1e-3, grad_norm=0.75, loss_scale=1.0,
                                   skipped=None, seconds=0.25, nonfinite_steps=0, perf=None,
                                   experts=None)
    if Trainer.is_log_step(trainer):
        result.perf = trainer.meter.read()
    for cb in callbacks:
        cb.post_step(trainer, result)


def test_console_line_fields_and_quiet_ranks():
    from depthmix.pretrain.callbacks import ConsoleLogger

    for logging_rank in (True, False):
        lines = []
        trainer = _fake_trainer(logging_rank)
        console = ConsoleLogger(printer=lines.append)
        for _ in range(4):
            _step(trainer, [console])
        if not logging_rank:
            assert lines == []
            continue
        assert len(lines) == 3  # step 1, then every log_interval=2 steps
        line = lines[-1]
        # 1000 tokens / 0.25 s = 4000 tok/s; x 6 GFLOP / 2 devices = 12 TFLOP/s; / 10 = 120%
        for part in ("step      4/10", "loss 2.5000", "lr 1.000e-03", "grad 0.750", "scale 1",
                     "4,000 tok/s", "12.00 TFLOP/s", "MFU 120.0%", "rss ", "0.250 s/step"):
            assert part in line, (part, line)


def test_progress_bar_carries_the_log_lines(capsys):
    from depthmix.pretrain.callbacks import ConsoleLogger, ProgressBar

    trainer = _fake_trainer(True)
    bar, console = ProgressBar(force=True), ConsoleLogger()
    bar.pre_train(trainer)
    for _ in range(2):
        _step(trainer, [console, bar])
    assert bar.bar.n == 2
    bar.close(trainer)
    out = capsys.readouterr()
    assert "step      2/10" in out.out and "step" in out.err  # line above, bar on stderr
