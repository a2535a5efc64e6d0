#!/bin/bash
# One node of a depthmix SLURM job (run by train.sbatch through srun, one task per node):
# torchrun starts DEPTHMIX_NPROC_PER_NODE ranks and joins the c10d rendezvous at
# MASTER_ADDR:MASTER_PORT with the job id as rendezvous id. Arguments: Hydra overrides.
set -euo pipefail

: "${MASTER_ADDR:?set by train.sbatch}" "${MASTER_PORT:?set by train.sbatch}"
NPROC_PER_NODE=${DEPTHMIX_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}

# SLURM delivers a step signal to every process of the step. USR1 is for the ranks (save
# and stop); torchrun must not die of it: an ignored signal stays ignored across exec and
# in torchrun's children until depthmix installs its handler in each rank.
trap '' USR1
# On SIGTERM torchrun forwards it and waits this long before killing the ranks (newer torch).
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-600}
# ...and then exits 1 even when every rank saved and exited 0. Each rank that exits 0 leaves
# a mark here; the marks decide this node's status. SIGTERM/SIGINT reach torchrun and the
# ranks from SLURM directly: this shell only has to outlive torchrun.
DEPTHMIX_EXIT_DIR=$(mktemp -d "${TMPDIR:-/tmp}/depthmix-exit.XXXXXX")
export DEPTHMIX_EXIT_DIR
trap ':' TERM INT

set +e
"${DEPTHMIX_PYTHON:-python}" -m torch.distributed.run \
    --nnodes="${SLURM_NNODES:-1}" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
    --rdzv-id="${SLURM_JOB_ID:-depthmix}" \
    --max-restarts=0 \
    -m depthmix.cli.train "$@"
status=$?
set -e
marks=$(find "$DEPTHMIX_EXIT_DIR" -name 'rank*' | wc -l)
if [ "$status" -ne 0 ] && [ "$marks" -eq "$NPROC_PER_NODE" ]; then
    echo "[depthmix] torchrun exited ${status} after a signal, but all ${marks} ranks of" \
         "$(hostname) saved and exited 0: exit 0"
    status=0
fi
rm -rf "$DEPTHMIX_EXIT_DIR"
exit "$status"
