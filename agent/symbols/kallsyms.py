"""Kernel text symbols from /proc/kallsyms, held as sorted address arrays and one name blob."""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_right

KALLSYMS_PATH = "/proc/kallsyms"

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
        entries: list[tuple[int, int, int, bytes, int]] = []
        modules: dict[bytes, int] = {}
        weak: list[tuple[int, bytes, int]] = []
        stext = etext = None
        for line in data.splitlines():
            parts = line.split()
            if len(parts) < 3:
                continue
            try:
                addr = int(parts[0], 16)
            except ValueError:
                continue
            # kptr_restrict makes every address read as zero; such lines carry no information.
            if addr == 0:
                continue
            kind, name = parts[1], parts[2]
            mod = 0
            if len(parts) > 3 and parts[3].startswith(b"["):
                mod = modules.setdefault(parts[3].strip(b"[]"), len(modules) + 1)
            if kind in _TEXT_TYPES:
                # Rank: global text first, then local, for choosing among aliases at one address.
                entries.append((addr, 0 if kind == b"T" else 1, len(name), name, mod))
                if mod == 0 and name == b"_stext":
                    stext = addr
                elif mod == 0 and name == b"_etext":
                    etext = addr
            elif kind in _WEAK_TYPES:
                weak.append((addr, name, mod))
            else:
                entries.append((addr, 3, len(name), name, _BOUNDARY))
        # Weak symbols may name data; keep them as functions only inside kernel text (or in modules,
        # whose text we cannot bound from kallsyms alone).
        for addr, name, mod in weak:
            in_text = mod != 0 or stext is None or etext is None or stext <= addr < etext
            if in_text:
                entries.append((addr, 2, len(name), name, mod))
            else:
                entries.append((addr, 3, len(name), name, _BOUNDARY))
        entries.sort()

        addrs = array("Q")
        mods = array("H")
        name_offs = array("I", [0])
        names: list[bytes] = []
        pos = 0
        count = 0
        last = None
        for addr, _rank, length, name, mod in entries:
            if addr == last:
                continue  # the first after sorting is the preferred alias
            last = addr
            addrs.append(addr)
            mods.append(mod)
            names.append(name)
            pos += length
            name_offs.append(pos)
            count += mod != _BOUNDARY
        self._addrs = addrs
        self._mods = mods
        self._name_offs = name_offs
        self._names = b"".join(names)
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
