"""A file's table as the kernel holds it (agent/unwind/kernel_maps.py `paged`, agent/bpf/unwind.h): a page
index of 64 KB pages, then 4-byte rows naming their rule by id. Looked up as cpu_sampler.c's
unwind_find_rule does (one page's rows searched), it must give every address the rule `table.lookup` gives
it: on real files (libc, the Python binary) and on tables made to hit the edges (a first row inside a page,
pages with no row, rows exactly at page starts, a page whose every byte starts a row). The BPF side itself
is tested by walking real stacks (tests/agent/test_unwind_bpf.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from fleetprof.agent.unwind.kernel_maps import PAGE_SHIFT, paged
from fleetprof.agent.unwind.table import NO_INFO, UnwindTable, load_table, lookup

NO_INFO_ID = 0


def find_rule(words: np.ndarray, base: int, pages: int, rules: list[int], vaddr: int) -> int:
    """unwind_find_rule's steps, over the words as BPF reads them."""
    page = vaddr >> PAGE_SHIFT
    if page < base or page - base >= pages:
        return NO_INFO
    rows = pages + 1
    lo, hi = rows + int(words[page - base]), rows + int(words[page - base + 1])
    assert lo < hi, f"page {page} has no row"
    off = vaddr & 0xFFFF
    for _ in range(16):
        if hi - lo <= 1:
            break
        mid = lo + (hi - lo) // 2
        if int(words[mid]) & 0xFFFF <= off:
            lo = mid
        else:
            hi = mid
    assert hi - lo <= 1, "a page's search took more than 16 steps"
    assert int(words[lo]) & 0xFFFF <= off
    return rules[int(words[lo]) >> 16]


def as_paged(table: UnwindTable) -> tuple[int, int, np.ndarray, list[int]]:
    """The table paged with rule ids as the unwinder hands them out (NO_INFO's is 0): (first page, pages,
    the words as unwind_rows holds them, rule by id)."""
    distinct = [NO_INFO, *sorted(set(table.rules.tolist()) - {NO_INFO})]
    id_of = {r: i for i, r in enumerate(distinct)}
    ids = np.array([id_of[r] for r in table.rules.tolist()], dtype=np.uint32)
    t = paged(table.pcs, ids, NO_INFO_ID)
    assert t.index.dtype == np.uint32 and t.rows.dtype == np.uint32
    return t.base, t.pages, np.concatenate((t.index, t.rows)), distinct


def expected(table: UnwindTable, vaddr: int) -> int:
    rule = lookup(table, vaddr)
    return NO_INFO if rule is None else rule


def check(table: UnwindTable, addresses: np.ndarray) -> None:
    base, pages, words, rules = as_paged(table)
    assert words.dtype == np.uint32 and len(words) >= pages + 1 + len(table)
    bad = [
        (hex(a), find_rule(words, base, pages, rules, a), expected(table, a))
        for a in addresses.tolist()
        if find_rule(words, base, pages, rules, a) != expected(table, a)
    ]
    assert not bad, bad[:10]


def addresses_of(table: UnwindTable, rng: np.random.Generator) -> np.ndarray:
    """Every row's first byte and the byte before it, page starts and ends, random addresses, and some
    below the first row and past the last page."""
    pcs = table.pcs.astype(np.int64)
    first, last = int(pcs[0]) >> PAGE_SHIFT, int(pcs[-1]) >> PAGE_SHIFT
    edges = np.arange(first - 1, last + 3, dtype=np.int64) << PAGE_SHIFT
    return np.unique(
        np.concatenate(
            (
                pcs,
                pcs - 1,
                edges,
                edges - 1,
                rng.integers(max(int(pcs[0]) - 4096, 0), int(pcs[-1]) + 70_000, 20_000),
            )
        ).clip(0, (1 << 32) - 1)
    )


def made(pcs: list[int], rules: list[int]) -> UnwindTable:
    """A table of these rows; one rule more than rows is the rule of a last row, one byte past the last."""
    if len(rules) > len(pcs):
        pcs = [*pcs, pcs[-1] + 1]
    return UnwindTable(np.array(pcs, dtype=np.uint32), np.array(rules, dtype=np.uint32))


# Each ends with a NO_INFO row, as every built table does (each FDE's end gets one: table.py); past the last
# page BPF reads NO_INFO.
@pytest.mark.parametrize(
    "name, table",
    [
        (
            "first row inside a page, pages without rows",
            made([0x12345, 0x12400, 0x58000, 0x9FFFF], [8, 16, 5, 9, 5]),
        ),
        ("rows exactly at page starts", made([0x10000, 0x20000, 0x20001, 0x30000], [8, 16, 24, 5])),
        ("one function", made([0x4242, 0x4250], [17, 5])),
        ("a row at address 0", made([0, 0x10, 0x10000], [8, 5, 16, 5])),
        (
            "every byte of a page starts a row",
            made([*range(0x30000, 0x40000), 0x40000], [*(8 * (i % 7 + 1) for i in range(65536)), 5]),
        ),
    ],
)
def test_paged_rows_give_each_address_the_rule_of_the_table(name: str, table: UnwindTable) -> None:
    check(table, addresses_of(table, np.random.default_rng(1)))


@pytest.mark.parametrize("path", ["/usr/lib/x86_64-linux-gnu/libc.so.6", sys.executable])
def test_paged_rows_of_real_files(path: str) -> None:
    real = Path(path).resolve()
    if not real.exists():
        pytest.skip(f"{real} is not on this machine")
    table = load_table(str(real))
    assert len(table) > 0 and int(table.rules[-1]) == NO_INFO  # past the last page, BPF reads NO_INFO too
    check(table, addresses_of(table, np.random.default_rng(2)))
    base, pages, words, _ = as_paged(table)
    # 4 bytes a row, the index and a row at each page's start on top: at most ~half the 8-byte rows' bytes.
    assert words.nbytes <= table.nbytes // 2 + 8 * (pages + 1), (words.nbytes, table.nbytes, pages)
