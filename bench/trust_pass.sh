#!/usr/bin/env bash
# A new user's (and a hostile one's) pass over the trust issue's areas, as commands: inputs checked before the
# first step, read-only output folders, swap folders that do not exist or are tmpfs (train, generate, env), plans
# for other hardware, a pickle payload planted in a checkpoint with its checksum rewritten, DeepSpeed's
# zero_to_fp32.py in a save folder, NaNs in a checkpoint exported and generated, model files with mixed dtypes
# and with overlapping tensors, the studio and `serve` asked by a rebinding page, the studio on ::1. Each case
# prints `=== CASE name`, the product's last lines and its exit status; `DANGER` where a payload ran or a folder
# was made where none should be. Needs root (a read-only bind mount) and the checkout's .venv.
#
#   bash bench/trust_pass.sh > bench/results/trust_pass/<machine>/output.txt
set -u
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
A="$REPO/.venv/bin/aidaptiv-ds"
PY="$REPO/.venv/bin/python"
W=$(mktemp -d /tmp/aidaptiv-trust-pass-XXXXXX)
SHM=/dev/shm/aidaptiv-trust-pass
trap 'umount "$W/rodir" 2>/dev/null; rm -rf "$W" "$SHM"' EXIT
mkdir -p "$W/swap"
cd "$W"
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$REPO/.torch_extensions}
CONFIG="$REPO/ds_configs/aidaptiv.json"
echo "trust pass: git $(git -C "$REPO" rev-parse --short HEAD), $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) cores"
case_() { echo; echo "=== CASE $1"; }
show() { tail -n "${2:-2}" "$1" | cut -c1-400; }
train() { $A train --config "$CONFIG" --model micro --nvme-path "$W/swap" "$@" >o.log 2>&1; }

# Inputs and the places a run writes: checked before the first step.
for args in "--lr nan" "--lr inf" "--lr -1" "--micro-batch 0" "--grad-accum 0" "--steps 0"; do
  case_ "train $args"
  t0=$(date +%s)
  # shellcheck disable=SC2086
  train --steps 2 $args
  echo "rc=$? after $(($(date +%s) - t0)) s"; show o.log 1
done
mkdir -p rodir && mount --bind rodir rodir && mount -o remount,bind,ro rodir
for flag in --output-dir --save-dir; do
  case_ "train $flag on a read-only file system"
  train --steps 2 "$flag" rodir/out
  echo "rc=$?"; show o.log 1
done
umount rodir

# Swap folders: one rule for every command (generate's cases come once there is a model with weights).
mkdir -p "$SHM"
for p in /nonexistent/swap "$SHM"; do
  case_ "train --nvme-path $p"
  $A train --config "$CONFIG" --model micro --steps 2 --nvme-path "$p" >o.log 2>&1
  echo "rc=$?"; show o.log 1; [ -e /nonexistent ] && echo "DANGER: /nonexistent was created"
done
case_ "env --nvme-path on tmpfs"
$A env --nvme-path "$SHM" 2>&1 | grep -i -E "o_direct" | head -2

# Plans for other hardware.
case_ "plan llama2-70b on 8 x 80 GB, no rates given"
t0=$(date +%s)
$A plan --model llama2-70b --seq-len 2048 --micro-batch 1 --gpus 8 --gpu-mem 80GB --host-mem 1TB >o.log 2>&1
echo "rc=$? after $(($(date +%s) - t0)) s"; grep -E "note: planned for other hardware" o.log | cut -c1-400
case_ "plan --gpu-mem 40"
$A plan --model llama2-7b --gpu-mem 40 --host-mem 192GB >o.log 2>&1
echo "rc=$?"; show o.log 1

# A trained checkpoint, then damaged: a pickle payload (a torch file, checksum rewritten), NaNs in params.bin.
case_ "train micro with --save-dir (the checkpoint the next cases damage)"
train --steps 4 --save-every 2 --save-dir ck
echo "rc=$?"; show o.log 1
cp -r ck ck_planted
"$PY" - "$W" <<'EOF'
import glob, json, os, sys, zlib

import torch


class Payload:
    def __reduce__(self):
        return (os.system, (f"touch {sys.argv[1]}/PWNED",))


f = glob.glob("ck_planted/step4/*optim_states.pt")[0]
torch.save({"optimizer_state_dict": Payload()}, f)  # a torch zip file like the real one, with a payload inside
data = open(f, "rb").read()
sums = "ck_planted/step4/checksums.json"
d = json.load(open(sums))
d["files"][os.path.basename(f)] = [len(data), zlib.crc32(data) & 0xFFFFFFFF]  # a CRC is no authenticity check
json.dump(d, open(sums, "w"))
EOF
case_ "train --resume auto over the planted optimizer state"
train --steps 6 --save-dir ck_planted --resume auto
echo "rc=$?"; grep -E "skipped|refus|resumed|status=" o.log | cut -c1-400; [ -e PWNED ] && echo "DANGER: the payload ran"
case_ "DeepSpeed's habit: zero_to_fp32.py in that save folder"
(cd ck_planted && "$PY" zero_to_fp32.py . out.bin >../o.log 2>&1; echo "rc=$?"); show o.log 1
[ -e PWNED ] && echo "DANGER: the payload ran"
cp -r ck ck_nan
"$PY" - <<'EOF'
import glob, struct

f = glob.glob("ck_nan/step4/**/params.bin", recursive=True)[0]
with open(f, "r+b") as fh:
    fh.seek(4096)
    fh.write(struct.pack("<f", float("nan")))
EOF
case_ "export of a checkpoint with a NaN in params.bin"
$A export ck_nan/step4 --out nan_out >o.log 2>&1
echo "rc=$?"; show o.log 1; [ -e nan_out/model.safetensors ] && echo "DANGER: a model was written"
case_ "generate from that checkpoint"
$A generate --model ck_nan/step4 --prompt hi --max-new-tokens 2 --nvme-path "$W/swap" >o.log 2>&1
echo "rc=$?"; show o.log 1

# Model files: mixed dtypes work; overlapping tensors are refused.
$A export ck/step4 --out good >/dev/null 2>&1
"$PY" - <<'EOF'
import json, shutil, struct

import torch
from safetensors.torch import load_file, save_file

sd = load_file("good/model.safetensors")
shutil.copytree("good", "mixed")
save_file({k: v.float() if "norm" in k else v.to(torch.bfloat16) for k, v in sd.items()}, "mixed/model.safetensors",
          metadata={"format": "pt"})
shutil.copytree("good", "overlap")
raw = open("good/model.safetensors", "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
header = json.loads(raw[8:8 + n])
a, b = [k for k in header if k != "__metadata__"][:2]
start = header[a]["data_offsets"][0]
header[b]["data_offsets"] = [start, start + header[b]["data_offsets"][1] - header[b]["data_offsets"][0]]
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
open("overlap/model.safetensors", "wb").write(struct.pack("<Q", len(h)) + h + raw[8 + n:])
EOF
for p in /nonexistent/swap "$SHM"; do
  case_ "generate --nvme-path $p"
  $A generate --model good --prompt hi --max-new-tokens 2 --nvme-path "$p" --host-budget 1MiB >o.log 2>&1
  echo "rc=$?"; show o.log 1; [ -e /nonexistent ] && echo "DANGER: /nonexistent was created"
done
case_ "generate with fp32 norms and bf16 weights"
$A generate --model mixed --prompt hi --max-new-tokens 3 --nvme-path "$W/swap" >o.log 2>&1
echo "rc=$?"; show o.log 1
case_ "generate with overlapping tensor offsets"
$A generate --model overlap --prompt hi --max-new-tokens 3 --nvme-path "$W/swap" >o.log 2>&1
echo "rc=$?"; show o.log 1

# The studio and serve, asked by a page whose name resolves to this machine; the studio on ::1.
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
$A studio --root "$W/studio" --port "$PORT" >studio.log 2>&1 &
SP=$!
for _ in $(seq 90); do curl -s -o /dev/null "http://127.0.0.1:$PORT/" && break; sleep 1; done
case_ "studio: a rebinding request (Host evil.example, Origin http://evil.example)"
curl -s -i -H "Host: evil.example:$PORT" -H 'Origin: http://evil.example' -X POST -H 'Content-Type: application/json' \
  -d '{"data":[]}' "http://127.0.0.1:$PORT/gradio_api/call/on_load" | grep -i -E "^HTTP|access-control"
case_ "studio: its own page"
curl -s -o /dev/null -w "%{http_code}\n" "http://127.0.0.1:$PORT/"
kill "$SP"; wait "$SP" 2>/dev/null
case_ "studio --host ::1"
$A studio --root "$W/studio" --host ::1 --port "$PORT" >o.log 2>&1 &
SP=$!
for _ in $(seq 90); do curl -s -g -o /dev/null "http://[::1]:$PORT/" && break; sleep 1; done
curl -s -g -o /dev/null -w "%{http_code}\n" "http://[::1]:$PORT/"
kill "$SP"; wait "$SP" 2>/dev/null
echo "tracebacks in its log: $(grep -c Traceback o.log)"
$A serve --model good --port "$PORT" --nvme-path "$W/swap" >serve.log 2>&1 &
SP=$!
for _ in $(seq 90); do curl -s -o /dev/null "http://127.0.0.1:$PORT/v1/models" && break; sleep 1; done
case_ "serve: a request addressed to another host"
curl -s -i -H "Host: evil.example" "http://127.0.0.1:$PORT/v1/models" | grep -E "^HTTP"
case_ "serve: a foreign origin"
curl -s -i -H 'Origin: http://evil.example' "http://127.0.0.1:$PORT/v1/models" | grep -i -E "^HTTP|access-control"
kill "$SP"; wait "$SP" 2>/dev/null
echo
echo "=== done"
