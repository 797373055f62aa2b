#!/bin/bash
# Submit a grid as a SLURM job array, one cell per task:
#   bench/slurm/submit_array.sh GRID OUT [sweep args that select cells, e.g. --gpus 1 --backends aidaptiv]
# The array is sized with `sweep --count-cells` under the same arguments the tasks will use, and each task
# asks for the most GPUs any selected cell needs (GPUS=N asks for N instead; GPUS=0 on CPU nodes, where a
# cell's "GPUs" are its CPU processes and a GPU request is refused: "Invalid generic resource"). PARALLEL
# (default 4) caps tasks running at once; extra sbatch options go in SBATCH_ARGS (e.g. "--partition=a100
# --account=proj", or "--cpus-per-task=2" on small CPU nodes). Prints sbatch's answer.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 GRID OUT [sweep args]" >&2
    exit 2
fi
GRID=$1 OUT=$2
shift 2
SWEEP_ARGS="$*"
SWEEP=${SWEEP:-aidaptiv-ds sweep}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# shellcheck disable=SC2086
n=$($SWEEP --grid "$GRID" --count-cells $SWEEP_ARGS)
if [ "$n" -eq 0 ]; then
    echo "$GRID selects no cells" >&2
    exit 1
fi
# shellcheck disable=SC2086
gpus=${GPUS:-$($SWEEP --grid "$GRID" --list-cells $SWEEP_ARGS | sed -n 's/.*__g\([0-9]*\)__.*/\1/p' | sort -n | tail -1)}
mkdir -p "$OUT"
export GRID OUT SWEEP SWEEP_ARGS
# shellcheck disable=SC2086
sbatch --export=ALL --array="0-$((n - 1))%${PARALLEL:-4}" --gpus="$gpus" ${SBATCH_ARGS:-} "$here/sweep_array.sbatch"
