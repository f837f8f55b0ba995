"""The `fleetprof` command: parse the flags, run the subcommand, turn query failures into one line."""

from __future__ import annotations

import logging
import sys

from fleetprof.cli.commands import COMMANDS
from fleetprof.cli.parser import build_parser
from fleetprof.client import QueryError


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[args.command](args)
    except QueryError as err:
        print(f"fleetprof {args.command}: {err}", file=sys.stderr)
        return 1
