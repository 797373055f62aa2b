"""The ``aidaptiv-ds`` command: one subcommand per job, each in its own module.

Each subcommand module offers ``add_arguments(parser)`` and ``run(args) -> int``; modules are imported
only when their subcommand is built, and heavy imports (torch, deepspeed) happen inside ``run``.
"""
import argparse
import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS = {
    "train": ("aidaptiv_ds.train", "fine-tune a causal LM with DeepSpeed ZeRO-3 (and our NVMe swapper)"),
    "io-bench": ("aidaptiv_ds.harness.io_bench", "measure NVMe read/write bandwidth of the I/O engines"),
    "sweep": ("aidaptiv_ds.harness.sweep", "run a batch x sequence x GPU grid against the baselines"),
    "report": ("aidaptiv_ds.harness.report", "make tables and plots from a sweep's results.jsonl"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aidaptiv-ds",
        description="Fine-tune language models larger than GPU memory by streaming state through NVMe.",
    )
    # The deepspeed launcher puts --local_rank=N before the subcommand (`python -m aidaptiv_ds --local_rank=0
    # train ...`); ranks read LOCAL_RANK from the environment, so the value is only accepted.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
            # A subcommand whose module is not in this build (yet): listed, but says so when run.
            p = sub.add_parser(name, help=f"{help_text} (not in this build)")
            p.set_defaults(_module=None, _missing=module_name)
            continue
        doc = (module.__doc__ or help_text).strip()
        p = sub.add_parser(name, help=help_text, description=doc,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args._module is not None:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args._module is None:
        print(f"aidaptiv-ds {args.command}: not available in this build ({args._missing} is missing)",
              file=sys.stderr)
        return 2
    return int(args._module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
