#!/bin/bash
# Single-node training with torchrun (no SLURM):
#   launch/local.sh model=500m mixer=depth_attn parallel=tp2 train=paper   # one rank per GPU
#   NPROC_PER_NODE=2 launch/local.sh model=tiny parallel=tp2        # CPU (gloo) works too
# Arguments are depthmix-train (Hydra) overrides. Output: outputs/local/<start time>/...,
# or outputs/<name> with run.name=<name>. To resume, rerun with run.name=local/<start
# time>/<model>_<mixer> (the run's closing summary prints the whole command), or with the
# same DEPTHMIX_RUN_KEY (printed below).
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

exec "${DEPTHMIX_PYTHON:-python}" -m torch.distributed.run --standalone \
    --nproc-per-node="$NPROC_PER_NODE" -m depthmix.pretrain.train "$@"
