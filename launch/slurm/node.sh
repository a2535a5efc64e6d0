#!/bin/bash
# One node of a depthmix SLURM job (run by train.sbatch through srun, one task per node):
# torchrun starts DEPTHMIX_NPROC_PER_NODE ranks and joins the c10d rendezvous at
# MASTER_ADDR:MASTER_PORT with the job id as rendezvous id. Arguments: Hydra overrides.
#
# torchrun runs through `python -m depthmix.runtime.torchrun` (the same arguments): its own
# messages go to <run dir>/torchrun.<host>.log (torchrun.log on one node), not to the job
# log, a signal stop ends without its SignalException traceback, and the status is 0 when
# every rank of this node saved and exited 0 (torchrun alone exits 1 after a signal).
# DEPTHMIX_LAUNCH_VERBOSE=1 prints torchrun's messages in the job log as well.
set -euo pipefail

: "${MASTER_ADDR:?set by train.sbatch}" "${MASTER_PORT:?set by train.sbatch}"
NPROC_PER_NODE=${DEPTHMIX_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}

# SLURM delivers a step signal to every process of the step. USR1 is for the ranks (save
# and stop); torchrun must not die of it: an ignored signal stays ignored across exec and
# in torchrun's children until depthmix installs its handler in each rank.
trap '' USR1
# On SIGTERM torchrun forwards it and waits this long before killing the ranks (newer torch).
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-600}
# SIGTERM/SIGINT reach torchrun and the ranks from SLURM directly: this shell only has to
# outlive torchrun (bash runs a trap only once its foreground command has ended).
trap ':' TERM INT

"${DEPTHMIX_PYTHON:-python}" -m depthmix.runtime.torchrun \
    --nnodes="${SLURM_NNODES:-1}" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
    --rdzv-id="${SLURM_JOB_ID:-depthmix}" \
    --max-restarts=0 \
    -m depthmix.cli.train "$@"
