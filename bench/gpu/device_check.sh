#!/usr/bin/env bash
# One session's checks on a lent GPU machine, in one command (device time is short: see docs/DESIGN.md).
#
#   Here:    ../shared/device/prepare.sh .device   (DeepSpeed wheel, pydantic, liburing), then
#            cp /usr/include/libaio.h .device/liburing/include; cp /usr/lib/x86_64-linux-gnu/libaio.so.1 into
#            .device/liburing/lib as libaio.so and libaio.so.1 (DeepSpeed's async_io needs libaio; the GPU
#            machine has none); and .venv/bin/python -m pip download -q --no-deps -d .device/whl
#            accelerate==1.15.0 (generate builds its model empty with accelerate, and accelerate's disk offload is
#            its baseline; the GPU machine may not have it: the machine phase says)
#   There:   OUT=<folder> bash bench/gpu/device_check.sh [seconds]     (carry .device)
#            With 15 minutes of device time: BACKENDS=aidaptiv,zero_infinity_eqmem TEST_S=180 ... 540 (the
#            H100 session, bench/results/gpu_probe/h100, ran the shipped ZeRO-Infinity too; the baselines
#            are rerun beside aidaptiv on the same machine, never taken from an earlier session)
#
# Phases, each logged to $OUT and each allowed to fail without stopping the next: the machine's facts;
# the engine built with its CUDA copy path while DeepSpeed's JIT ops build beside it; tests/gpu; host<->GPU
# copy bandwidth and GPU FLOP/s; io-bench on this machine's disk; generation with the GPU capped (ours against
# accelerate's offload and ZeRO-Inference, the inference issue's GPU figures; GEN_S seconds, default 200, 0 gives
# the sweep its time); then the cells of bench/grids/gpu_probe.json (or $GRID) until the deadline, with --resume
# so a later session carries on from what came back.
set -u
T0=$(date +%s)
DEADLINE=${1:-420}
OUT=${OUT:-/tmp/device-out}
GRID=${GRID:-bench/grids/gpu_probe.json}
BACKENDS=${BACKENDS:-}      # e.g. aidaptiv,zero_infinity_eqmem: the grid's backends when empty
RES=/tmp/gpu_probe          # sweep results, op build logs, io-bench: one tarball back (at most 8 files come back)
mkdir -p "$OUT" "$RES"
exec > >(tee -a "$OUT/run.log") 2>&1
elapsed() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE - $(elapsed) )); }
phase() { echo; echo "=== [+$(elapsed)s] $*"; }

source .device/activate.sh || { echo "activate failed"; exit 1; }
export LD_LIBRARY_PATH="$PWD/.device/liburing/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="/tmp/site/bin:$PATH" PYTHONPATH="$PWD:$PYTHONPATH" PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0
export AIDAPTIV_DS_CACHE_DIR=/tmp/aidaptiv-cache

phase "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -c 'import torch, transformers, deepspeed; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "deepspeed", deepspeed.__version__)'
python3 -c 'import accelerate; print("accelerate", accelerate.__version__)' || echo "accelerate MISSING: generate's tests and bench fail"
nvcc --version | tail -2; nproc; free -g | head -2; df -hT . /tmp | cat; lsblk -d -o NAME,SIZE,ROTA,MODEL | cat
cat /proc/cpuinfo | grep -m1 "model name"

phase "DeepSpeed JIT ops (background) and the engine with CUDA"
ops=()   # their pids: a bare `wait` would also wait for the tee above, which never ends (bash >= 5.1)
for op in CPUAdamBuilder AsyncIOBuilder FusedAdamBuilder; do
  python3 -m aidaptiv_ds.zero3.op_builds $op > "$RES/op_$op.log" 2>&1 &
  ops+=($!)
done
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; echo "engine build rc=$?"
tail -3 "$OUT/build.log"
python3 -c 'import torch; from aidaptiv_ds.engine import _C; print("engine WITH_CUDA =", _C.WITH_CUDA)'
phase "engine built; waiting for the ops"
for pid in "${ops[@]}"; do   # polled, so a hung build cannot eat the deadline
  while kill -0 "$pid" 2>/dev/null && [ "$(left)" -gt 60 ]; do sleep 2; done
done
cat "$RES"/op_*.log | grep -E "ready|failed|compatible|Error" | tail -6

phase "tests/gpu"
timeout $(( $(left) > ${TEST_S:-200} ? ${TEST_S:-200} : $(left) )) python3 -m pytest -q -rA -p no:cacheprovider tests/gpu -n 4 \
  > "$OUT/pytest.log" 2>&1; echo "pytest rc=$?"
grep -E "passed|failed|PASSED|FAILED|ERROR|zero3 |aidaptiv " "$OUT/pytest.log" | tail -30

phase "host<->GPU copy and GPU FLOP/s"
python3 - <<'EOF'
import time, torch
from aidaptiv_ds.planner.rates import probe_gpu
r = probe_gpu("bf16"); print(f"pinned H2D {r['pcie']/1e9:.1f} GB/s, bf16 matmul {r['gpu_flops']/1e12:.0f} TFLOP/s")
n = 256 << 20
host = torch.empty(n, dtype=torch.uint8).pin_memory(); dev = torch.empty(n, dtype=torch.uint8, device="cuda")
host.copy_(dev, non_blocking=True); torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(5): host.copy_(dev, non_blocking=True)
torch.cuda.synchronize(); print(f"pinned D2H {5*n/(time.perf_counter()-t)/1e9:.1f} GB/s")
EOF

phase "io-bench on this disk"
[ "$(left)" -gt 100 ] && timeout 60 python3 -m aidaptiv_ds io-bench --size-mb ${IO_MB:-1024} --repeat 1 --engines uring,deepspeed \
  > "$RES/io_bench.txt" 2>&1; echo "io-bench rc=$?"; cat "$RES/io_bench.txt" | tail -8

GEN_S=${GEN_S:-200}
phase "generate, GPU capped at 1.5 GiB: ours vs accelerate vs ZeRO-Inference (at most $GEN_S s)"
if [ "$GEN_S" -gt 0 ] && [ "$(left)" -gt $(( GEN_S + 60 )) ]; then
  # tinyllama-1.1b shape in bf16 (2.2 GB of weights) with 1.5 GiB of GPU and a 1 GiB host budget for weights:
  # some layers on the GPU, some in host memory, the rest from the disk. Rows are written as they come
  # (rows.jsonl); a cut run's summary: python bench/generate_offload.py --summary-only --out <its folder>.
  timeout -s INT "$GEN_S" python3 bench/generate_offload.py --device cuda --dtype bfloat16 --budget 1GiB \
    --gpu-cap-gib 1.5 --cap-gib 6 --repeats 1 --new-tokens 8 --kv-prefix 2048 --kv-repeats 1 --kv-cap-gib 8 \
    --work /tmp/gen_work --out "$RES/generate_offload_gpu" > "$OUT/generate.log" 2>&1; echo "generate rc=$?"
  grep -E '^\{|x\*\*|failed|Error' "$OUT/generate.log" | tail -14
fi

phase "sweep $GRID until the deadline ($(left) s left)"
if [ "$(left)" -gt 60 ]; then
  timeout -s INT $(( $(left) - 15 )) python3 -m aidaptiv_ds sweep --grid "$GRID" --out "$RES" --resume \
    --no-progress --host-mem-cap-mechanism auto ${BACKENDS:+--backends $BACKENDS} > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
  tail -25 "$OUT/sweep.log"
  python3 -m aidaptiv_ds report "$RES" > "$RES/report.log" 2>&1; echo "report rc=$?"
fi
tar czf "$OUT/gpu_probe.tgz" --exclude=swap -C /tmp gpu_probe
phase "done"
