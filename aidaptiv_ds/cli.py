"""The ``aidaptiv-ds`` command: one subcommand per job, each a module of :mod:`aidaptiv_ds.commands`.

Each command module offers ``add_arguments(parser)`` and ``run(args) -> int``. Only the chosen
subcommand's module is imported (the ``deepspeed`` launcher starts every rank as ``python -m aidaptiv_ds
train ...``, which must not depend on the other subcommands), and heavy imports (torch, deepspeed)
happen inside ``run``.
"""

import argparse
import faulthandler
import importlib
import os
import sys

from aidaptiv_ds.harness.prebuild import put_build_tools_first

# name -> (module under aidaptiv_ds.commands, one-line help)
SUBCOMMANDS = {
    "plan": ("plan", "before launch: does a job fit, how fast will it run, with which config"),
    "train": ("train", "fine-tune a causal LM with DeepSpeed ZeRO-3 (and our NVMe swapper)"),
    "export": ("export", "write a checkpoint's model as a Hugging Face folder (safetensors shards)"),
    "generate": ("generate", "generate text, weights streamed from NVMe, prompts cached on SSD"),
    "serve": ("serve", "serve a model over the OpenAI HTTP API (completions, chat, streaming), batched"),
    "io-bench": ("io_bench", "measure NVMe read/write bandwidth of the I/O engines"),
    "sweep": ("sweep", "run a batch x sequence x GPU grid against the baselines"),
    "report": ("report", "make tables and plots from a sweep's results.jsonl"),
    "studio": ("studio", "the workflow in a browser: data, plan and train, runs, compare"),
    "env": ("env", "print what a bug report needs: versions, CPU, GPU, disk, limits"),
}


def short_description(doc: str) -> str:
    """A command's ``--help`` description: its module docstring's summary and the indented examples right
    after it (the rest of the docstring is the module's documentation, and docs/USAGE.md the manual)."""
    paragraphs = (doc or "").strip().split("\n\n")
    out = paragraphs[:1]
    if len(paragraphs) > 1 and all(line.startswith("  ") for line in paragraphs[1].splitlines()):
        out.append(paragraphs[1])
    return "\n\n".join(out)


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one subcommand (imports its module). A module may add ``HELP_EPILOG`` (exit codes, say)."""
    module = importlib.import_module(f"aidaptiv_ds.commands.{SUBCOMMANDS[command][0]}")
    epilog = "\n\n".join(
        part for part in (getattr(module, "HELP_EPILOG", ""), "The manual: docs/USAGE.md in the repository.") if part
    )
    parser = argparse.ArgumentParser(
        prog=f"aidaptiv-ds {command}",
        description=short_description(module.__doc__),
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    parser.set_defaults(_module=module)
    return parser


def _drop_local_rank(argv):
    """The deepspeed launcher puts --local_rank=N before the subcommand (``python -m aidaptiv_ds
    --local_rank=0 train ...``); ranks read LOCAL_RANK from the environment, so it is dropped."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if not out and (a.startswith("--local_rank=") or a.startswith("--local-rank=")):
            continue
        if not out and a in ("--local_rank", "--local-rank"):
            skip = True
            continue
        out.append(a)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """Parse a whole command line; the result's ``_module`` is the chosen subcommand's module."""
    argv = _drop_local_rank(sys.argv[1:] if argv is None else list(argv))
    commands = "\n".join(f"  {name:<10} {help_text}" for name, (_, help_text) in SUBCOMMANDS.items())
    top = argparse.ArgumentParser(
        prog="aidaptiv-ds",
        description="Fine-tune language models larger than GPU memory by streaming state through NVMe.",
        epilog=f"commands:\n{commands}\n\n'aidaptiv-ds COMMAND --help' shows a command's options.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    top.add_argument("command", choices=list(SUBCOMMANDS), metavar="COMMAND", help="one of the commands below")
    top.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    ns = top.parse_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    from aidaptiv_ds.commands.flags import warn_deprecated

    warn_deprecated(argv[1:], f"aidaptiv-ds {ns.command}")
    return build_parser(ns.command).parse_args(argv[1:])


def main(argv=None) -> int:
    # A native crash (a segfault in an extension, a CUDA driver abort) then prints every thread's Python
    # stack to stderr instead of dying silently; the sweep reads the crashing frame from it (fault_line).
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable(all_threads=True)
        except (AttributeError, ValueError, OSError):  # stderr replaced by an object without a file descriptor
            pass
    # Every subcommand may make DeepSpeed compile an op; this process and everything it starts (launcher
    # ranks, sweep cells) then use the same build tools as every other run sharing the op cache.
    put_build_tools_first(os.environ)
    args = parse_args(argv)
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
