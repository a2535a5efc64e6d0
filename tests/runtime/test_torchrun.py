"""``python -m depthmix.runtime.torchrun``, in this process: torchrun's log waits for the run
directory and never reaches the console (unless verbose); only the first death signal
stops torchrun. The launches themselves: ``tests/runtime/test_preemption.py`` (local.sh) and
``tests/runtime/test_launch.py`` (SLURM)."""

from __future__ import annotations

import logging
import os
import signal

import pytest

from depthmix.runtime import torchrun


def _record(name: str = "torch.distributed.elastic.agent.server.api"):
    return logging.LogRecord(name, logging.WARNING, __file__, 1,
                             "Received 15 death signal, shutting down workers", None, None)


def test_log_waits_for_the_run_directory(tmp_path, capsys):
    exit_dir, run_dir = tmp_path / "exit", tmp_path / "run"
    exit_dir.mkdir()
    run_dir.mkdir()
    log = torchrun.RunDirLog(str(exit_dir), "torchrun.log")
    log.emit(_record())  # no run directory yet: held
    assert log.held and not (run_dir / "torchrun.log").exists()
    (exit_dir / torchrun.RUN_DIR_FILE).write_text(f"{run_dir}\n")
    log.emit(_record("torch.distributed.run"))
    log.close()
    lines = (run_dir / "torchrun.log").read_text().splitlines()
    assert len(lines) == 2 and all(line.endswith("shutting down workers") for line in lines)
    assert " WARNING torch.distributed.run: " in lines[1]
    assert capsys.readouterr().err == ""


def test_log_without_a_run_directory_ends_on_stderr(tmp_path, capsys):
    """The ranks stopped before they reported one: what torchrun said is not lost."""
    log = torchrun.RunDirLog(str(tmp_path), "torchrun.log")
    log.emit(_record())
    log.close()
    assert capsys.readouterr().err.rstrip().endswith("Received 15 death signal, shutting "
                                                     "down workers")
    assert os.listdir(tmp_path) == []


class Spy(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_torch_distributed_records_go_to_the_log(tmp_path, monkeypatch, verbose):
    """torch's own console handlers (on ``torch.distributed`` and on children that do not
    propagate, e.g. ``torch.distributed.rendezvous``) see nothing unless verbose."""
    import torch.distributed.run  # noqa: F401 (creates torchrun's loggers)

    top, child = logging.getLogger("torch.distributed"), \
        logging.getLogger("torch.distributed.rendezvous")
    console = Spy()
    for logger in (top, child):
        monkeypatch.setattr(logger, "handlers", [console])
        monkeypatch.setattr(logger, "propagate", False)
    exit_dir = tmp_path / "exit"
    exit_dir.mkdir()
    (exit_dir / torchrun.RUN_DIR_FILE).write_text(str(tmp_path))
    log = torchrun.RunDirLog(str(exit_dir), "torchrun.log")
    with torchrun._torch_logs_to(log, verbose):
        logging.getLogger("torch.distributed.elastic.agent.server.api").warning("death signal")
        child.warning("rendezvous closed")
    log.close()
    assert top.handlers == [console] and child.handlers == [console]  # restored
    assert [line.split(": ", 1)[1] for line in
            (tmp_path / "torchrun.log").read_text().splitlines()] == \
        ["death signal", "rendezvous closed"]  # each record once
    assert console.messages == (["death signal", "rendezvous closed"] if verbose else [])


def test_only_the_first_death_signal_stops_torchrun(monkeypatch):
    """The first raises torchrun's SignalException (it forwards the signal and waits for
    the ranks); a repeated SIGTERM is ignored while the ranks save."""
    from torch.distributed.elastic.multiprocessing import api

    monkeypatch.setattr(api, "_terminate_process_handler", api._terminate_process_handler)
    torchrun._once_per_launch()
    with pytest.raises(api.SignalException):
        api._terminate_process_handler(signal.SIGTERM, None)
    assert api._terminate_process_handler(signal.SIGTERM, None) is None
    assert api._terminate_process_handler(signal.SIGHUP, None) is None


def _child_failed(*exitcodes: int):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    return ChildFailedError("depthmix.cli.train", {
        rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="")
        for rank, code in enumerate(exitcodes)})


def test_a_failed_rank_ends_torchrun_with_its_status(tmp_path, capsys):
    """A configuration error (status 2, printed by the ranks) adds nothing and drops
    torchrun's shutdown notes; a crash or a signal adds one line naming the rank."""
    log = torchrun.RunDirLog(str(tmp_path), "torchrun.log")
    log.emit(_record())
    assert torchrun._failed(_child_failed(2, -15), log, verbose=False) == 2
    log.close()
    assert capsys.readouterr().err == ""
    log = torchrun.RunDirLog(str(tmp_path), "torchrun.log")
    assert torchrun._failed(_child_failed(3), log, verbose=False) == 3
    assert torchrun._failed(_child_failed(-9), log, verbose=False) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == ["[depthmix] rank 0 ended with status 3; torchrun's log: above",
                   "[depthmix] rank 0 ended with signal SIGKILL; torchrun's log: above"]
