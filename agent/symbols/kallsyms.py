"""Kernel text symbols from /proc/kallsyms, held as sorted address arrays and one name blob."""

from __future__ import annotations

import re
import sys
from array import array
from bisect import bisect_right

KALLSYMS_PATH = "/proc/kallsyms"

_LINE = re.compile(rb"^([0-9a-fA-F]+)[ \t]+(\S+)[ \t]+(\S+)(?:[ \t]+\[([^\]\s]+)\])?", re.M)
_TEXT_TYPES = frozenset((b"t", b"T"))
_WEAK_TYPES = frozenset((b"w", b"W"))
# Module index marking an entry that only ends the symbol before it (a data symbol, or weak data).
_BOUNDARY = 0xFFFF


class KernelSymbols:
    """Kernel function symbols, looked up by address; `available` is False when addresses are hidden."""

    __slots__ = ("_addrs", "_name_offs", "_names", "_mods", "_modules", "_count")

    def __init__(self, text: str | bytes | None = None, path: str = KALLSYMS_PATH) -> None:
        """Parse `text` (kallsyms content) or, when it is None, read `path`; raises OSError if unreadable."""
        if text is None:
            with open(path, "rb") as f:
                text = f.read()
        elif isinstance(text, str):
            text = text.encode()
        self._parse(text)

    def _parse(self, data: bytes) -> None:
        # Only arrays outlive the parse. Per-line objects are transient (one regex match at a time), so
        # the ~200k lines leave no fragmented heap behind: a list of tuples here cost the agent +26 MB RSS.
        n_addr, n_rank, n_mod = array("Q"), array("B"), array("H")
        n_start, n_end = array("I"), array("I")
        modules: dict[bytes, int] = {}
        weak_at: list[int] = []  # indices of weak entries, resolved once _stext/_etext are known
        stext = etext = None
        for m in _LINE.finditer(data):
            addr = int(m.group(1), 16)
            if addr == 0:  # kptr_restrict makes every address read as zero: no information
                continue
            kind = m.group(2)
            mod_name = m.group(4)
            mod = modules.setdefault(mod_name, len(modules) + 1) if mod_name else 0
            if kind in _TEXT_TYPES:
                rank = 0 if kind == b"T" else 1  # global text first, then local, among aliases
                if mod == 0:
                    name = m.group(3)
                    if name == b"_stext":
                        stext = addr
                    elif name == b"_etext":
                        etext = addr
            elif kind in _WEAK_TYPES:
                weak_at.append(len(n_addr))
                rank = 2
            else:
                rank, mod = 3, _BOUNDARY
            n_addr.append(addr)
            n_rank.append(rank)
            n_mod.append(mod)
            n_start.append(m.start(3))
            n_end.append(m.end(3))
        # Weak symbols may name data; keep them as functions only inside kernel text (or in modules,
        # whose text we cannot bound from kallsyms alone).
        for i in weak_at:
            if n_mod[i] == 0 and stext is not None and etext is not None and not stext <= n_addr[i] < etext:
                n_rank[i], n_mod[i] = 3, _BOUNDARY
        order = sorted(
            range(len(n_addr)),
            key=lambda i: (n_addr[i], n_rank[i], n_end[i] - n_start[i], data[n_start[i] : n_end[i]]),
        )

        addrs, mods, name_offs = array("Q"), array("H"), array("I", [0])
        names = bytearray()
        count = 0
        last = None
        for i in order:
            addr = n_addr[i]
            if addr == last:
                continue  # the first after sorting is the preferred alias
            last = addr
            addrs.append(addr)
            mods.append(n_mod[i])
            names += data[n_start[i] : n_end[i]]
            name_offs.append(len(names))
            count += n_mod[i] != _BOUNDARY
        self._addrs = addrs
        self._mods = mods
        self._name_offs = name_offs
        self._names = bytes(names)
        self._modules: tuple[str | None, ...] = (None,) + tuple(
            m.decode("utf-8", "replace") for m in sorted(modules, key=modules.__getitem__)
        )
        self._count = count

    @property
    def available(self) -> bool:
        """False when no text symbol had a nonzero address (kptr_restrict, or no permission)."""
        return self._count > 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Approximate memory held by the arrays and the name blob."""
        return (
            sys.getsizeof(self._addrs)
            + sys.getsizeof(self._mods)
            + sys.getsizeof(self._name_offs)
            + sys.getsizeof(self._names)
        )

    def lookup(self, addr: int) -> tuple[str, str | None] | None:
        """(function name, module name or None for the core kernel) of the symbol at or before `addr`."""
        i = bisect_right(self._addrs, addr) - 1
        if i < 0:
            return None
        mod = self._mods[i]
        if mod == _BOUNDARY:
            return None
        name = self._names[self._name_offs[i] : self._name_offs[i + 1]].decode("utf-8", "replace")
        return name, self._modules[mod]

    def address_of(self, name: str) -> int | None:
        """Start address of the text symbol `name` (a linear scan; for tools and tests, not the hot path)."""
        want = name.encode()
        start = 0
        while True:
            pos = self._names.find(want, start)
            if pos < 0:
                return None
            i = bisect_right(self._name_offs, pos) - 1
            if self._name_offs[i] == pos and self._name_offs[i + 1] == pos + len(want):
                if self._mods[i] != _BOUNDARY:
                    return self._addrs[i]
            start = pos + 1
