"""The `fleetprof` command: parse the flags, run the subcommand, turn query failures into one line."""

from __future__ import annotations

import logging
import re
import sys

from fleetprof.cli.commands import COMMANDS
from fleetprof.cli.parser import build_parser, dash_values
from fleetprof.client import QueryError

# The collector names the API's parameters in its refusals ('bad "from2": ...'); a CLI user gave flags.
_PARAMETER = re.compile(r'"(query2?|since2?|from2?|until2?|max_nodes|limit|sort|by|type|threads|gpu)"')


def flag_names(message: str) -> str:
    """A collector's message with the API parameters it names written as the flags that set them."""
    return _PARAMETER.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)


# What the long-running commands are called in top, ps and profiles (fleetprof/procname.py).
PROCESS_NAMES = {"agent": "fleetprof-agent", "collector": "fleetprof-collector", "demo": "fleetprof-demo"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(dash_values(sys.argv[1:] if argv is None else argv))
    if args.command in PROCESS_NAMES and argv is None:  # a process of its own, not a caller's main(argv)
        from fleetprof.procname import name_process

        name_process(PROCESS_NAMES[args.command])
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return COMMANDS[args.command](args)
    except QueryError as err:
        print(f"fleetprof {args.command}: {flag_names(str(err))}", file=sys.stderr)
        return 1
