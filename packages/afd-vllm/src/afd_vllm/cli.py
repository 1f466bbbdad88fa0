"""The ``afd-vllm`` command: the FFN role (``afd-vllm ffn``) and a tiny checkpoint to try
the plugin with (``afd-vllm tiny-model``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from afd_vllm import ffn_server, tiny_model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="afd-vllm", description="afd's vLLM plugin tools")
    sub = parser.add_subparsers(dest="command", required=True)
    ffn_server.add_parser(sub)
    tiny_model.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.run(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
