#!/bin/bash
# Single-node training with torchrun (no SLURM):
#   launch/local.sh model=500m mixer=depth_attn parallel=tp2 train=paper   # one rank per GPU
#   NPROC_PER_NODE=2 launch/local.sh model=tiny parallel=tp2        # CPU (gloo) works too
# Arguments are depthmix-train (Hydra) overrides. Output: outputs/local/<start time>/...,
# or outputs/<name> with run.name=<name>. To resume, rerun with run.name=local/<start
# time>/<model>_<mixer> (the run's closing summary prints the whole command), or with the
# same DEPTHMIX_RUN_KEY (printed below).
#
# Signals: SIGTERM (kill <pid of this script>), SIGUSR1, SIGHUP and Ctrl-C make every rank
# finish its step or eval batch, save and exit; the status is then 0 and the run's closing
# summary ends the console. A second Ctrl-C aborts at once without saving (status 130).
#
# torchrun runs through `python -m depthmix.runtime.torchrun` (the same arguments), which
# keeps torchrun's own messages (its signal handling: "Received 15 death signal", the
# SignalException traceback) off the console: they go to <run dir>/torchrun.log. With
# DEPTHMIX_LAUNCH_VERBOSE=1 they are printed as well.
set -euo pipefail

if [ -z "${NPROC_PER_NODE:-}" ]; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        NPROC_PER_NODE=$(nvidia-smi -L | grep -c '^GPU')
    else
        NPROC_PER_NODE=1
    fi
fi
DEPTHMIX_RUN_KEY=${DEPTHMIX_RUN_KEY:-local/$(date +%Y-%m-%d_%H-%M-%S)}
export DEPTHMIX_RUN_KEY
echo "[depthmix] ${NPROC_PER_NODE} rank(s); DEPTHMIX_RUN_KEY=${DEPTHMIX_RUN_KEY}"

# On a signal torchrun forwards it to the ranks and waits this long before killing them.
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-600}

# torchrun runs in its own session: a signal for this script (or Ctrl-C on the terminal)
# reaches it once, forwarded below, never twice. It exits 0 when every rank saved and
# exited 0, also after a signal (torchrun alone exits 1 then).
setsid "${DEPTHMIX_PYTHON:-python}" -m depthmix.runtime.torchrun --standalone \
    --nproc-per-node="$NPROC_PER_NODE" -m depthmix.cli.train "$@" &
torchrun_pid=$!

interrupts=0
# shellcheck disable=SC2329  # invoked by the traps below
forward() {
    if [ "$1" = INT ]; then
        interrupts=$((interrupts + 1))
        if [ "$interrupts" -ge 2 ]; then  # second Ctrl-C: straight to the ranks, which abort
            pkill -INT -P "$torchrun_pid" || true
            return
        fi
    fi
    if [ "$1" = USR1 ]; then  # torchrun does not forward USR1 (it would die of it)
        pkill -USR1 -P "$torchrun_pid" || true
        return
    fi
    kill -s "$1" "$torchrun_pid" 2>/dev/null || true
}
trap 'forward TERM' TERM
trap 'forward TERM' HUP
trap 'forward INT' INT
trap 'forward USR1' USR1

# `wait` returns early (status > 128) when a trap runs; keep waiting for torchrun itself.
set +e
while :; do
    wait "$torchrun_pid"
    status=$?
    if [ "$status" -gt 128 ] && kill -0 "$torchrun_pid" 2>/dev/null; then
        continue
    fi
    break
done
set -e

if [ "$interrupts" -ge 2 ]; then
    status=130
fi
exit "$status"
