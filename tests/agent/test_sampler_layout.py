"""agent/sampler.py's mirrors of cpu_sampler.c (its structs, the ring buffers' structs and STAT_NAMES) are
the C side's: read from the C files for every field and stat, and from the loaded program's own map types
(BCC builds them from the C file as compiled) at every load."""

from __future__ import annotations

import ctypes as ct
import re
from pathlib import Path

import pytest

from fleetprof.agent import sampler
from fleetprof.agent.bpfmaps import CounterDeltas
from fleetprof.agent.model import ProcessEvent
from fleetprof.agent.sampler import (
    MAX_DEPTH,
    PY_MAX_DEPTH,
    STAT_FOLLOW_UPS,
    STAT_NAMES,
    CpuSampler,
    OffcpuValue,
    PyFrame,
    PyNewStack,
    PyStack,
    SampleKey,
    SamplerConfig,
    StackTrace,
)

BPF = Path(sampler.__file__).parent / "bpf"
SOURCES = [BPF / "cpu_sampler.c", BPF / "python_stack.h", BPF / "process_event.h"]
MIRRORS = {
    "sample_key": SampleKey,
    "stack_trace": StackTrace,
    "py_frame": PyFrame,
    "py_stack": PyStack,
    "py_new_stack": PyNewStack,
    "offcpu_value": OffcpuValue,
    "process_event": ProcessEvent,
}
SCALARS = {"u8": 1, "char": 1, "u32": 4, "u64": 8}
LENGTHS = {"MAX_DEPTH": MAX_DEPTH, "PY_MAX_DEPTH": PY_MAX_DEPTH}  # the lengths the sampler compiles with
FIELD = re.compile(r"(struct \w+|\w+) (\w+)(?:\[(\w+)\])?;")


def c_text(path: Path) -> str:
    """The file without comments."""
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", path.read_text(), flags=re.S)


def c_structs() -> dict[str, list[tuple[str, str, int]]]:
    """struct name -> its fields as (type, name, array length or 0), from the sampler's C files."""
    out = {}
    for path in SOURCES:
        for name, body in re.findall(r"^struct (\w+) \{(.*?)^\};", c_text(path), flags=re.S | re.M):
            fields = []
            for line in filter(None, (x.strip() for x in body.splitlines())):
                m = FIELD.fullmatch(line)
                assert m, f"{path.name}: struct {name}: cannot read {line!r}"
                typ, field, length = m.groups()
                fields.append((typ, field, int(LENGTHS.get(length, length)) if length else 0))
            out[name] = fields
    return out


def c_layout(structs: dict, name: str) -> tuple[int, int, list[tuple[str, int, int]]]:
    """(size, alignment, [(field, offset, size)]) of a struct as C lays it out (natural alignment)."""
    offset, align, fields = 0, 1, []
    for typ, field, length in structs[name]:
        if typ.startswith("struct "):
            size, a, _ = c_layout(structs, typ.removeprefix("struct "))
        else:
            size = a = SCALARS[typ]
        offset = -(-offset // a) * a
        total = size * (length or 1)
        fields.append((field, offset, total))
        offset += total
        align = max(align, a)
    return -(-offset // align) * align, align, fields


def ctypes_layout(ctype: type) -> tuple[int, list[tuple[str, int, int]]]:
    return ct.sizeof(ctype), [
        (name, getattr(ctype, name).offset, ct.sizeof(typ)) for name, typ, *_ in ctype._fields_
    ]


def test_every_struct_user_space_reads_has_its_mirror_field_by_field() -> None:
    structs = c_structs()
    assert set(MIRRORS) <= set(structs), set(MIRRORS) - set(structs)
    for name, mirror in MIRRORS.items():
        size, _, fields = c_layout(structs, name)
        assert ctypes_layout(mirror) == (size, fields), f"struct {name} and {mirror.__name__} differ"


def test_every_stat_the_c_side_counts_has_a_name_and_no_name_is_left_over() -> None:
    text = c_text(BPF / "cpu_sampler.c")
    stats = re.findall(r"^#define (STAT_\w+)\s+(\d+)\s*$", text, flags=re.M)
    (nstats,) = re.findall(r"^#define NSTATS\s+(\d+)\s*$", text, flags=re.M)
    indices = sorted(int(i) for _, i in stats)
    assert indices == list(range(len(stats))), "STAT_* indices must run 0..NSTATS-1, each once"
    assert int(nstats) == len(stats) == len(STAT_NAMES)
    assert len(set(STAT_NAMES)) == len(STAT_NAMES)
    # Every stat defined is counted somewhere, and every one counted is defined and named.
    defined = {name for name, _ in stats}
    body = re.sub(r"^#define STAT_\w+.*$", "", text, flags=re.M)
    body += "".join(c_text(BPF / f) for f in ("unwind.h", "python_stack.h", "cuda_probes.c"))
    assert set(re.findall(r"\bSTAT_[A-Z0-9_]+\b", body)) == defined


@pytest.mark.bpf
def test_the_loaded_program_s_map_types_are_the_mirrors_and_a_stat_on_one_side_fails_the_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tests.conftest import require_bpf

    require_bpf()
    cpu = CpuSampler(SamplerConfig(frequency_hz=19, off_cpu=True, python=True))
    try:
        bpf = cpu._bpf
        assert sampler.layout(bpf["counts0"].Key) == sampler.layout(SampleKey)
        assert sampler.layout(bpf["offcpu0"].Leaf) == sampler.layout(OffcpuValue)
        sampler._check_layouts(bpf, off_cpu=True)  # the load ran it too: in sync
        monkeypatch.setattr(sampler, "STAT_NAMES", (*STAT_NAMES, "a_stat_only_python_knows"))
        with pytest.raises(RuntimeError, match="STAT_NAMES"):
            sampler._check_layouts(bpf, off_cpu=True)
        monkeypatch.undo()

        class Wider(ct.Structure):  # SampleKey with a field the C side lacks
            _fields_ = [*SampleKey._fields_, ("extra", ct.c_uint64)]

        monkeypatch.setattr(sampler, "SampleKey", Wider)
        with pytest.raises(RuntimeError, match="out of sync"):
            sampler._check_layouts(bpf, off_cpu=True)
    finally:
        cpu.close()


def test_drained_bytes_parse_to_the_fields_the_ctypes_mirrors_hold() -> None:
    """The drain parses raw map bytes with struct formats; each field must land where the C struct (as
    mirrored) put it, for every field of a key, a stack and a CPython stack."""
    key = SampleKey(
        tgid=11,
        tid=12,
        cgroup_id=13,
        user_stack=14,
        kernel_stack=15,
        python_stack=16,
        gpu_slot=17,
        comm=b"w\xffk",
    )
    (row,) = sampler._sample_counts(sampler._KEY.iter_unpack(bytes(key)), [99], idle={(11, 12)})
    assert (row.tgid, row.tid, row.cgroup_id, row.user_stack, row.kernel_stack) == (11, 12, 13, 14, 15)
    assert (row.python_stack, row.gpu_slot, row.count, row.idle) == (16, 17, 99, True)
    # Idle is a thread's, named by (tgid, tid): the same tid in another process (reused) is not idle.
    (other,) = sampler._sample_counts(sampler._KEY.iter_unpack(bytes(key)), [99], idle={(99, 12)})
    assert not other.idle
    assert row.comm == "w\ufffdk"  # bytes after the NUL dropped, invalid UTF-8 replaced

    deep, short = StackTrace(), StackTrace()
    deep.len = MAX_DEPTH + 5  # a length past the array is cut to it
    for i in range(MAX_DEPTH):
        deep.ip[i] = 1000 + i
    short.len, short.ip[0], short.ip[1] = 2, 7, 8
    ids = (ct.c_uint64 * 2)(0xFFFF_FFFF_FFFF_FFF0, 5)
    stacks = sampler._stacks(bytes(ids), bytes(deep) + bytes(short))
    assert stacks == {0xFFFF_FFFF_FFFF_FFF0: tuple(range(1000, 1000 + MAX_DEPTH)), 5: (7, 8)}

    py = PyStack()
    py.len = 2
    py.frames[0] = PyFrame(0xDEAD_BEEF_0000, 40, 0x0100_0001)
    py.frames[1] = PyFrame(3, 4, 5)
    py_stacks = sampler._python_stacks(bytes((ct.c_uint64 * 1)(9)), bytes(py))
    assert py_stacks == {9: ((0xDEAD_BEEF_0000, 40, 0x0100_0001), (3, 4, 5))}


class _ScriptedCounters:
    """A per-CPU array of cumulative counters in the BCC table's shape (indexed by c_int, a value per CPU),
    set between reads by the test."""

    def __init__(self, n: int) -> None:
        self.values = [0] * n

    def __getitem__(self, key: ct.c_int) -> list[int]:
        return [self.values[key.value], 0]


class _CountersUnderWalks(_ScriptedCounters):
    """... into which one whole walk lands between any two lookups: the walk counted at its start, its end
    after."""

    WALKS, END = STAT_NAMES.index("unwind_walks"), STAT_NAMES.index("unwind_end")

    def __getitem__(self, key: ct.c_int) -> list[int]:
        value = super().__getitem__(key)
        self.values[self.WALKS] += 1
        self.values[self.END] += 1
        return value


def test_counter_deltas_never_read_more_ends_than_walks() -> None:
    """The counters are read one lookup at a time while BPF programs run; a walk that starts and ends
    between the lookups of its two counters must not show as an end without its walk (a fresh-clone run's
    agent exported 42,704 walk ends of 42,703 walks)."""
    table = _CountersUnderWalks(len(STAT_NAMES))
    deltas = CounterDeltas(table, STAT_NAMES)
    walks = ends = 0
    for _ in range(3):
        d = deltas()
        walks, ends = walks + d["unwind_walks"], ends + d["unwind_end"]
        assert 0 < ends <= walks, (ends, walks)
    assert sum(table.values) > 0


def test_a_follow_up_counter_never_exceeds_its_event_in_a_window_and_its_total_stays_exact() -> None:
    """Launches sampled against launches (the collector refuses a batch with more of the first): a window
    that shows more follow-ups than events (events counted at the last read, their follow-ups after it: the
    arm64 guest's agent sent 242 sampled of 240 launches) reports at most its events and carries the rest.
    A chain (switch-outs, sampled, runnable) is bounded in order: runnable by the sampled *reported*."""
    table = _ScriptedCounters(len(STAT_NAMES))
    deltas = CounterDeltas(table, STAT_NAMES, STAT_FOLLOW_UPS)
    # (follow-up, event) deltas per window, for the launches and for the off-CPU chain's three counters
    launches = [(100, 102), (242, 240), (10, 13), (0, 0), (5, 4)]
    chain = [(50, 40, 40), (60, 70, 45), (10, 0, 0), (20, 30, 10)]  # (switches, sampled, runnable)
    got_launches, got_chain = [], []
    for i in range(max(len(launches), len(chain))):
        f, e = launches[i] if i < len(launches) else (0, 0)
        sw, sa, ru = chain[i] if i < len(chain) else (0, 0, 0)
        for name, d in [("cuda_launches_sampled", f), ("cuda_launches", e), ("offcpu_switches", sw),
                        ("offcpu_sampled", sa), ("offcpu_runnable", ru)]:  # fmt: skip
            table.values[STAT_NAMES.index(name)] += d
        d = deltas()
        assert 0 <= d["cuda_launches_sampled"] <= d["cuda_launches"] == e
        assert 0 <= d["offcpu_runnable"] <= d["offcpu_sampled"] <= d["offcpu_switches"] == sw
        got_launches.append(d["cuda_launches_sampled"])
        got_chain.append((d["offcpu_sampled"], d["offcpu_runnable"]))
    assert got_launches == [100, 240, 12, 0, 4]  # one sampled launch still carried: late, not lost
    assert got_chain == [(40, 40), (60, 45), (10, 0), (20, 10), (0, 0)]  # 10 sampled carried twice
    # Whatever is carried is reported once the events make room, and nothing is reported twice.
    table.values[STAT_NAMES.index("cuda_launches")] += 10
    table.values[STAT_NAMES.index("offcpu_switches")] += 100
    d = deltas()
    assert d["cuda_launches_sampled"] == 1 and sum(got_launches) + 1 == sum(f for f, _ in launches)
    assert sum(s for s, _ in got_chain) + d["offcpu_sampled"] == sum(c[1] for c in chain)
    assert sum(r for _, r in got_chain) + d["offcpu_runnable"] == sum(c[2] for c in chain)


def test_a_follow_up_pair_must_name_counters_of_the_table() -> None:
    with pytest.raises(ValueError, match="unknown counter"):
        CounterDeltas(_ScriptedCounters(len(STAT_NAMES)), STAT_NAMES, {"cuda_sampled": "cuda_launches"})
