"""A signal stops training where it is and saves (``PreemptionCallback``), in one process:
the handler only sets a flag that the step's all-reduce turns into a stop, submitit's own
handler runs after the save; SIGTERM during an evaluation stops within one eval batch and
saves the step it belongs to; Ctrl-C and SIGUSR1 save and stop. (Through torchrun and
``launch/local.sh``: ``tests/runtime/test_preemption.py``; a second Ctrl-C during a save:
``tests/checkpoint/test_save_guard.py``.)"""

import os
import signal

import pytest

from depthmix.checkpoint import store
from depthmix.pretrain.callbacks import CheckpointCallback, PreemptionCallback
from depthmix.pretrain.callbacks.base import Callback
from depthmix.testing import SyntheticData

from run_harness import trainer_saving_to


def test_preemption_flag_and_submitit_handover(megatron_single, monkeypatch):
    """In-process, one rank: a signal only sets the flag; the step's all-reduce turns it into
    a stop; under submitit its own handler runs at close (after the save), not before."""
    import types

    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    handed_over = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    signal.signal(signal.SIGUSR2, lambda signum, frame: handed_over.append(signum))
    stops = []
    trainer = types.SimpleNamespace(step=7, request_stop=stops.append,
                                    topo=types.SimpleNamespace(is_logging_rank=True))
    cb = PreemptionCallback()
    try:
        cb.setup(trainer)
        cb.post_step(trainer, None)
        assert stops == []  # no signal yet
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handed_over == []  # submitit's handler did not run in the signal handler
        cb.post_step(trainer, None)
        assert stops == ["preempted (SIGUSR2)"]
        cb.post_train(trainer)
        assert handed_over == []
        cb.close(trainer)
        assert handed_over == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGTERM) == previous[signal.SIGTERM]  # restored
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class SignalOnFirstEvalBatch(SyntheticData):
    """Validation data that sends a real SIGTERM to this process when the first evaluation
    starts, and counts the micro-batches drawn from then on."""

    drawn = 0

    def valid_iterator(self):
        for i, batch in enumerate(super().valid_iterator()):
            if i == 0 and SignalOnFirstEvalBatch.drawn == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            SignalOnFirstEvalBatch.drawn += 1
            yield batch



def test_sigterm_during_eval_saves_within_one_eval_batch(megatron_single, tmp_path):
    root = str(tmp_path / "ckpt")
    steps = []
    before = signal.getsignal(signal.SIGTERM)

    class Steps(Callback):
        def post_step(self, trainer, result):
            steps.append(trainer.step)

    t = trainer_saving_to(root, callbacks=[Steps(), CheckpointCallback(), PreemptionCallback()],
                 steps=20, eval_interval=2, eval_iters=50, data=SignalOnFirstEvalBatch)
    t.train()
    t.close()
    assert steps == [1, 2] and t.stop_reason == "preempted (SIGTERM)"
    assert SignalOnFirstEvalBatch.drawn == t.num_microbatches  # one eval batch of 50
    assert store.latest_checkpoint(root) == store.step_dir(root, 2)
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored



@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1],
                         ids=["ctrl_c", "sigusr1"])
def test_a_signal_after_a_step_saves_it_and_stops(megatron_single, tmp_path, signum):
    """Ctrl-C, or SIGUSR1 (what SLURM sends near the time limit, ``launch/slurm``)."""
    root = str(tmp_path / "ckpt")
    # SIGINT: Python's default_int_handler, or SIG_IGN where the process started ignoring
    # Ctrl-C (seen in a pytest-xdist worker under `coverage run`)
    before = signal.getsignal(signum)

    class Send(Callback):
        def post_step(self, trainer, result):
            if trainer.step == 2:
                os.kill(os.getpid(), signum)

    t = trainer_saving_to(root, callbacks=[Send(), CheckpointCallback(), PreemptionCallback()],
                 steps=20)
    t.train()
    t.close()
    assert t.step == 2 and t.stop_reason == f"preempted ({signal.Signals(signum).name})"
    assert store.latest_checkpoint(root) == store.step_dir(root, 2)
    assert signal.getsignal(signum) is before  # handlers restored
