"""Entry point of the ``afd`` command: one sub-command per module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from afd_protocol import AFDError
from afd_tools import __version__, roundtrip, soak
from afd_tools.bench import cli as bench_cli
from afd_tools.run import command as run_command
from afd_tools.sim import cli as sim_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afd",
        description="Asynchronous Attention-FFN Disaggregation (AFD) for MoE prefill.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"afd {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run_command.add_parser(sub)
    roundtrip.add_parser(sub)
    bench_cli.add_parser(sub)
    soak.add_parser(sub)
    sim_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except AFDError as exc:  # configuration and protocol errors: one line, no traceback
        print(f"afd {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
