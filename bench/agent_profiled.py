"""`fleetprof agent` with its drains under cProfile: how the drain's cost per sample was broken down.

    .venv/bin/python bench/agent_profiled.py FILE [agent flags...]

Runs the agent as `fleetprof agent` does; each drain (Agent.drain_once: read, resolve, encode) runs under
one cProfile.Profile, whose stats are written to FILE after every drain (so a killed agent leaves the
drains up to its last). The other threads are not profiled. bench/common.py's FleetprofAgent runs the
agent this way when FLEETPROF_BENCH_AGENT_PROFILE=FILE is set; read FILE with `python -m pstats FILE`.
"""

from __future__ import annotations

import cProfile
import sys

from fleetprof.agent import main as agent_main
from fleetprof.cli import main as cli_main


def profiled(path: str) -> None:
    profile = cProfile.Profile()
    drain_once = agent_main.Agent.drain_once

    def drain_profiled(self: agent_main.Agent):  # type: ignore[no-untyped-def]
        profile.enable()
        try:
            return drain_once(self)
        finally:
            profile.disable()
            profile.dump_stats(path)

    agent_main.Agent.drain_once = drain_profiled  # type: ignore[method-assign]


if __name__ == "__main__":
    profiled(sys.argv[1])
    sys.exit(cli_main(["agent", *sys.argv[2:]]))
