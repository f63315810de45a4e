#!/usr/bin/env bash
# Launch pretrain/main.py with mpirun; ranks come from MPI (mpi4py, through DeepSpeed's
# init_distributed), the first rank's host is the rendezvous address.
#
#   NP=16 HOSTFILE=hosts scripts/mpi_pretrain.sh --ds_config ds_configs/zero1.json \
#       --config transformer_1.3b
#   NP=2 MPI_ARGS="--allow-run-as-root --oversubscribe" scripts/mpi_pretrain.sh   # laptop / CI
#
# Environment: NP (ranks, default 2), HOSTFILE (mpirun hostfile, optional), MASTER_PORT
# (default 29500), MPI_ARGS (extra mpirun flags). Arguments go to main.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export MASTER_PORT=${MASTER_PORT:-29500}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# shellcheck disable=SC2086  # MPI_ARGS is a list of flags
exec mpirun -np "${NP:-2}" ${HOSTFILE:+-hostfile "$HOSTFILE"} ${MPI_ARGS:-} \
    -x MASTER_PORT -x OMP_NUM_THREADS -x PATH -x PYTHONPATH \
    python pretrain/main.py "$@"
