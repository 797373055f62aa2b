"""The optional parts of the package and the extras that install them (pyproject.toml's optional-dependencies).

A training node installs the core: `train`, `export`, `plan`, `generate`, `sweep`, `io-bench`. The studio, QLoRA,
the DeepSpeed monitors and the report's plots import their packages only where they are used, and when one is
missing say which extra brings it (``pip install 'aidaptiv-ds[studio]'``) instead of a bare ImportError.
"""

from __future__ import annotations

import importlib.util

# module -> (the distribution that provides it, the extra that installs it)
OPTIONAL = {
    "gradio": ("gradio", "studio"),
    "pandas": ("pandas", "studio"),  # gradio's own dependency; the studio's curves are its frames
    "pypdf": ("pypdf", "studio"),
    "docx": ("python-docx", "studio"),
    "bitsandbytes": ("bitsandbytes", "qlora"),
    "tensorboard": ("tensorboard", "tracking"),
    "wandb": ("wandb", "tracking"),
    "matplotlib": ("matplotlib", "report"),
    "gguf": ("gguf", "gguf"),
}
STUDIO = ("gradio", "pandas", "pypdf", "docx")


def missing(*modules: str) -> list[str]:
    """The modules of ``modules`` that are not installed (found without importing them)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def install_command(*modules: str) -> str:
    """The pip command that installs the extras bringing ``modules``."""
    extras = sorted({OPTIONAL[m][1] for m in modules})
    return f"pip install 'aidaptiv-ds[{','.join(extras)}]'"


def missing_message(purpose: str, modules) -> str:
    """One sentence: ``purpose`` needs these packages, which are not installed, and the command that adds them."""
    names = ", ".join(OPTIONAL[m][0] for m in modules)
    return f"{purpose} needs {names}, which {'is' if len(modules) == 1 else 'are'} not installed: {install_command(*modules)}"
