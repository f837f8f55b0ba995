"""Parse /proc/PID/maps into Mapping records and find the mapping that holds an address."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from fleetprof.agent.model import Mapping


def parse_maps(text: str, exec_only: bool = False) -> list[Mapping]:
    """Parse the text of /proc/PID/maps; lines that do not parse are skipped."""
    out: list[Mapping] = []
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 5:
            continue
        addrs, perms, offset, dev, inode = fields[:5]
        if exec_only and (len(perms) < 3 or perms[2] != "x"):
            continue
        try:
            start_s, _, end_s = addrs.partition("-")
            major_s, _, minor_s = dev.partition(":")
            mapping = Mapping(
                start=int(start_s, 16),
                end=int(end_s, 16),
                offset=int(offset, 16),
                dev_major=int(major_s, 16),
                dev_minor=int(minor_s, 16),
                inode=int(inode),
                path=fields[5] if len(fields) > 5 else "",
                perms=perms,
            )
        except ValueError:
            continue
        out.append(mapping)
    return out


def read_maps(pid: int, proc_root: str = "/proc", exec_only: bool = False) -> list[Mapping]:
    """Mappings of a live process; raises FileNotFoundError (or ProcessLookupError) once it has exited."""
    with open(f"{proc_root}/{pid}/maps", encoding="utf-8", errors="surrogateescape") as f:
        return parse_maps(f.read(), exec_only=exec_only)


def _start(m: Mapping) -> int:
    return m.start


def find(mappings: Sequence[Mapping], addr: int) -> Mapping | None:
    """The mapping containing `addr`; `mappings` must be sorted by start, as /proc/PID/maps lists them."""
    i = bisect_right(mappings, addr, key=_start) - 1
    if i >= 0 and addr < mappings[i].end:
        return mappings[i]
    return None
