"""Readable names: C++ and Rust linker names are demangled in every output of the collector (the JSON tree,
top, folded, SVG, HTML, speedscope, Grafana, Pyroscope's flamebearer, pprof, the diff views) and in
`fleetprof top`, while the raw name, as the agent sent it, stays the frame's identity and is reachable
(`system_name` in /top and pprof)."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetprof._proto.pyroscope import profile_pb2, querier_pb2
from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.cli.tables import format_top
from fleetprof.collector.model.profile import FrameKey
from fleetprof.collector.render import cxa_demangle, names
from fleetprof.collector.render.names import Demangler, Names
from fleetprof.collector.render.tree import to_folded, top_functions
from tests.collector.test_pprof import pprof
from tests.collector.test_pyroscope_api import CPU, SAMPLES, call, merge, nodes, now_ms
from tests.conftest import RunningCollector, fleetprof, http_get
from tests.support.wire import BatchBuilder, push

LLVM_RAW = "_ZN4llvm13StringMapImpl11RehashTableEj"
LLVM = "llvm::StringMapImpl::RehashTable(unsigned int)"
ENGINE_RAW = "_ZN5torch8autograd6Engine11thread_mainERKSt10shared_ptrINS0_9GraphTaskEE"
ENGINE = "torch::autograd::Engine::thread_main(std::shared_ptr<torch::autograd::GraphTask> const&)"
WRAP_RAW = "_ZN3c106detail19maybe_wrap_dim_slowEllb"
WRAP = "c10::detail::maybe_wrap_dim_slow(long, long, bool)"
# Rust's legacy mangling: two builds of one function (hashes differ), the same name once demangled.
RUST_A = "_ZN3foo3bar17h0123456789abcdefE"
RUST_B = "_ZN3foo3bar17hfedcba9876543210E"
RUST = "foo::bar"
# `<alloc::string::String as core::fmt::Display>::fmt`, with the legacy scheme's escapes.
_IMPL = "_$LT$alloc..string..String$u20$as$u20$core..fmt..Display$GT$"
RUST_IMPL_RAW = f"_ZN{len(_IMPL)}{_IMPL}3fmt17h1234567890abcdefE"
HZ = 100

needs_pyderust = pytest.mark.skipif(names.pyderust is None, reason="pyderust (rustc-demangle) not installed")


# -- display_name --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def display_name() -> Iterator[Names]:
    """Names as the collector shows them: a Demangler's (collector/main.py makes one), its helper process
    stopped after this module's tests."""
    demangler = Demangler()
    yield demangler.display_name
    demangler.close()


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (LLVM_RAW, LLVM),
        (ENGINE_RAW, ENGINE),
        (WRAP_RAW, WRAP),
        ("_ZNK2at6Tensor4sizeEl", "at::Tensor::size(long) const"),
        ("_ZN3foo3barEv.cold", "foo::bar() [clone .cold]"),  # GCC's hot/cold split
        (RUST_A, RUST),
        (RUST_B, RUST),
        (RUST_A + ".llvm.4711", RUST),  # LLVM's suffix on a Rust name
    ],
)
def test_mangled_names_are_shown_demangled(raw: str, shown: str, display_name: Names) -> None:
    assert display_name(raw) == shown


@pytest.mark.parametrize(
    "raw",
    [
        "slow_collate (<string>:5)",  # a Python frame
        "_Zfoo (x.py:3)",  # a Python function whose name happens to start like a mangled one
        "do_syscall_64",  # kernel
        "_raw_spin_lock",
        "[unknown] (libx.so+0x12)",
        "[freed python code]",
        "main",
        "",
        "other",
        "foo::bar()",  # demangled already (a symbolizer that demangles): shown as sent
        "_Zgarbage",  # starts like an Itanium name, is none
        "_Z",
        "_ZN4llvm13StringMapImpl",  # cut short
        "_ZN4llvm13StringMapImpl11RehashTableEj\u2026",  # cut by ingest's length limit
        "_RNvB_1a",  # a v0 back-reference to itself
        "_R",
    ],
)
def test_names_that_are_not_mangled_or_do_not_demangle_pass_through(raw: str, display_name: Names) -> None:
    assert display_name(raw) == raw


def compiled_symbols(tmp_path: Path) -> dict[str, str]:
    """raw -> nm -C's demangled name for the functions of a tiny C++ file: class template methods in
    nested namespaces, compiled by g++ here."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++ to compile real C++ symbols")
    src = tmp_path / "loader.cpp"
    src.write_text(
        "#include <string>\n#include <vector>\n"
        "namespace fleet { namespace ml {\n"
        "template <typename T> struct Loader {\n"
        "  int collate(const T& batch, int n);\n"
        "  static const void* cast(const std::string& name);\n"
        "};\n"
        "template <typename T> int Loader<T>::collate(const T& b, int n) { return n + (int)b.size(); }\n"
        "template <typename T> const void* Loader<T>::cast(const std::string& s) { return s.data(); }\n"
        "template struct Loader<std::vector<float>>;\n"
        "}}\n"
    )
    obj = tmp_path / "loader.o"
    subprocess.run([gxx, "-c", "-O0", "-o", str(obj), str(src)], check=True, timeout=120)

    def nm(*flags: str) -> list[str]:
        out = subprocess.run(["nm", "--defined-only", *flags, str(obj)], capture_output=True, text=True)
        return [line.split(" ", 2)[2] for line in out.stdout.splitlines() if line.count(" ") >= 2]

    return dict(zip(nm(), nm("-C"), strict=True))


def test_real_cxx_symbols_demangle_as_binutils_does(tmp_path: Path, display_name: Names) -> None:
    symbols = {raw: shown for raw, shown in compiled_symbols(tmp_path).items() if raw.startswith("_ZN5fleet")}
    vec = "std::vector<float, std::allocator<float> >"
    loader = f"fleet::ml::Loader<{vec} >"
    string = "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >"
    assert set(symbols.values()) == {
        f"{loader}::collate({vec} const&, int)",
        f"{loader}::cast({string} const&)",
    }
    for raw, shown in symbols.items():
        assert display_name(raw) == shown


def test_rust_legacy_names_lose_their_hash_even_without_rustc_demangle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GCC reads a legacy Rust name as `path::h<hash>`; the hash goes as rustc's demangler drops it. Without
    pyderust the legacy escapes stay as GCC prints them."""
    monkeypatch.setattr(names, "pyderust", None)
    d = Demangler()
    try:
        assert d.display_name(RUST_A) == RUST
        assert d.display_name(RUST_A + ".llvm.4711") == RUST
        assert d.display_name(RUST_IMPL_RAW) == f"{_IMPL}::fmt"
        assert d.display_name("_RNvC4test4main") == "_RNvC4test4main"  # v0 needs rustc-demangle
        assert d.display_name(LLVM_RAW) == LLVM
    finally:
        d.close()


@needs_pyderust
def test_rust_names_read_as_rustc_prints_them(display_name: Names) -> None:
    assert display_name(RUST_IMPL_RAW) == "<alloc::string::String as core::fmt::Display>::fmt"
    assert display_name("_RNvC4test4main") == "test::main"  # v0
    assert display_name("_RNvC4test4main.llvm.12") == "test::main"
    assert (
        display_name("_RNvMsr_NtCs3ssYzQotkvD_3std4pathNtB5_7PathBuf3newCs15kBYyAo9fc_7mycrate")
        == "<std::path::PathBuf>::new"
    )


def exponential_name(levels: int) -> str:
    """An Itanium name whose template arguments name the previous argument twice by back-reference: its
    demangled text doubles with each level (40 levels: 2**40 characters from 300 bytes)."""

    def sub(i: int) -> str:
        digits, n, out = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ", i - 1, ""
        if i == 0:
            return "S_"
        while True:
            out, n = digits[n % 36] + out, n // 36
            if not n:
                return f"S{out}_"

    parts, prev = ["1a", "1bIS_S_E"], 2
    for _ in range(levels):
        parts.append(f"S0_I{sub(prev)}{sub(prev)}E")
        prev += 1
    return "_Z1f" + "".join(parts)


def test_a_name_that_demangles_to_gigabytes_is_shown_raw_in_bounded_time(display_name: Names) -> None:
    small = exponential_name(3)
    assert display_name(small).startswith("f(a, b<a, a>, b<b<a, a>, b<a, a> >")  # the scheme is real
    d = Demangler()
    try:
        crafted = exponential_name(40)
        started = time.monotonic()
        assert d.display_name(crafted) == crafted
        assert time.monotonic() - started < names.DEADLINE_S + 5
        assert d.display_name(LLVM_RAW) == LLVM  # a new helper took over
        started = time.monotonic()
        assert d.display_name(crafted) == crafted  # remembered: not tried again
        assert time.monotonic() - started < 0.1
    finally:
        d.close()


def test_without_libstdcxx_names_stay_raw_and_it_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What the helper says when libstdc++ cannot be loaded...
    def no_library() -> None:
        raise OSError("libstdc++.so.6: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(cxa_demangle, "load", no_library)
    out = tmp_path / "said"
    with out.open("wb") as f:
        cxa_demangle.serve(iter([b"_Z1fv\n"]), f)
    said = out.read_bytes()
    assert said.startswith(b"unavailable ") and said.count(b"\n") == 1
    # ...and what the collector makes of it.
    fake = tmp_path / "helper.py"
    fake.write_text(f"import sys\nsys.stdout.write({said.decode()!r})\n")
    d = Demangler(helper_command=(sys.executable, str(fake)))
    with caplog.at_level(logging.WARNING, logger=names.__name__):
        assert [d.display_name(n) for n in (LLVM_RAW, ENGINE_RAW, LLVM_RAW)] == [
            LLVM_RAW,
            ENGINE_RAW,
            LLVM_RAW,
        ]
    warnings = [r.getMessage() for r in caplog.records if r.name == names.__name__]
    assert len(warnings) == 1 and "cannot open shared object file" in warnings[0]
    assert d.display_name("slow_collate (<string>:5)") == "slow_collate (<string>:5)"


def test_display_name_is_thread_safe_and_its_cache_bounded() -> None:
    d = Demangler(cache_entries=8)
    cases = {LLVM_RAW: LLVM, ENGINE_RAW: ENGINE, WRAP_RAW: WRAP, RUST_A: RUST, "main": "main"}
    cases.update({f"_Z{len(f'fn{i}')}fn{i}v": f"fn{i}()" for i in range(30)})
    wrong: list[tuple[str, str]] = []

    def work() -> None:
        for _ in range(3):
            for raw, shown in cases.items():
                got = d.display_name(raw)
                if got != shown:
                    wrong.append((raw, got))

    threads = [threading.Thread(target=work) for _ in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wrong == []
        assert len(d._cache) <= 8
    finally:
        d.close()


def test_renderers_show_the_names_they_are_given_and_run_no_demangler_of_their_own(
    display_name: Names,
) -> None:
    """The renderers are pure: they show each frame as the `names` they are given make it (the collector
    gives its Demangler's), as stored by default; render/names.py keeps no demangler of its own."""
    stacks = {(FrameKey("main", "app"), FrameKey(LLVM_RAW, "libLLVM.so")): 3}
    assert to_folded(stacks) == f"main;{LLVM_RAW} 3\n"
    assert to_folded(stacks, display_name) == f"main;{LLVM} 3\n"
    assert top_functions(stacks, names=display_name)[0] == {
        "function": LLVM,
        "system_name": LLVM_RAW,
        "module": "libLLVM.so",
        "kernel": False,
        "self": 3,
        "total": 3,
        "self_pct": 100.0,
        "total_pct": 100.0,
    }
    assert [v for v in vars(names).values() if isinstance(v, Demangler)] == []


def test_top_table_marks_kernel_frames_in_the_module_column() -> None:
    row = {"self": 1, "total": 1, "self_pct": 50.0, "total_pct": 50.0}
    data = {
        "query": "{}",
        "from": 0.0,
        "until": 10.0,
        "total": 2,
        "frequency_hz": HZ,
        "functions": [
            {**row, "function": "vfs_read", "module": "", "kernel": True},
            {**row, "function": "nv_ioctl", "module": "[kernel] nvidia", "kernel": True},
            {**row, "function": "memcpy", "module": "libc.so.6", "kernel": False},
        ],
    }
    lines = format_top(data).splitlines()
    assert lines[2].endswith("  vfs_read  [kernel]")
    assert lines[3].endswith("  nv_ioctl  [kernel] nvidia")
    assert lines[4].endswith("  memcpy  [libc.so.6]")
    assert "_[k]" not in format_top(data)


# -- through a real collector ----------------------------------------------------------------------------

# comm -> stacks of (function, module) root first, the kernel frames from the index given, and samples.
TRAINER = [
    ([("main", "python3"), (ENGINE_RAW, "libtorch_cpu.so"), (LLVM_RAW, "libLLVM.so")], None, 30),
    ([("main", "python3"), (ENGINE_RAW, "libtorch_cpu.so"), (WRAP_RAW, "libc10.so")], None, 20),
    ([("main", "python3"), (WRAP_RAW, "libc10.so"), ("do_syscall_64", "[kernel]")], 2, 10),
    ([("main", "python3"), (RUST_A, "libtok.so")], None, 7),
    ([("main", "python3"), (RUST_B, "libtok.so")], None, 3),
]
# A second workload for the diff: the same program spending its time elsewhere.
LOADER = [
    ([("main", "python3"), (ENGINE_RAW, "libtorch_cpu.so"), (LLVM_RAW, "libLLVM.so")], None, 5),
    ([("main", "python3"), (WRAP_RAW, "libc10.so"), ("do_syscall_64", "[kernel]")], 2, 45),
]


def batch() -> pb.Batch:
    b = BatchBuilder(node="node-d", frequency_hz=HZ)
    for pid, comm, stacks in ((1, "trainer", TRAINER), (2, "loader", LOADER)):
        proc = b.process(pid, comm, {"namespace": "ml", "pod": f"{comm}-0"})
        for frames, kernel_start, count in stacks:
            b.sample(proc, b.stack(frames, kernel_start), count)
    return b.build()


@pytest.fixture(scope="module")
def fed(module_collector: RunningCollector) -> RunningCollector:
    assert push(module_collector.grpc_target, [batch()]) == [1]
    return module_collector


TRAINER_Q = '{comm="trainer"}'
LOADER_Q = '{comm="loader"}'


def get(col: RunningCollector, path: str, **params: str) -> bytes:
    return http_get(f"{col.url}{path}?{urllib.parse.urlencode({'since': '10m', **params})}")


def test_top_shows_demangled_functions_with_their_raw_names(fed: RunningCollector) -> None:
    rows = fed.json("/api/v1/top", since="10m", query=TRAINER_Q, limit="20")["functions"]
    by_raw = {r.get("system_name", r["function"]): r for r in rows}
    assert by_raw[LLVM_RAW]["function"] == LLVM and by_raw[LLVM_RAW]["self"] == 30
    assert by_raw[ENGINE_RAW]["function"] == ENGINE and by_raw[ENGINE_RAW]["total"] == 50
    assert by_raw[WRAP_RAW]["function"] == WRAP and by_raw[WRAP_RAW]["self"] == 20
    # Unmangled names have no system_name; the kernel frame is flagged, not renamed.
    assert "system_name" not in by_raw["main"] and by_raw["main"]["total"] == 70
    kernel = by_raw["do_syscall_64"]
    assert (kernel["function"], kernel["kernel"], kernel["self"]) == ("do_syscall_64", True, 10)
    assert "system_name" not in kernel
    # Two functions whose names demangle alike stay two rows.
    assert (by_raw[RUST_A]["function"], by_raw[RUST_A]["self"]) == (RUST, 7)
    assert (by_raw[RUST_B]["function"], by_raw[RUST_B]["self"]) == (RUST, 3)
    assert len(rows) == 7


def test_folded_text_is_demangled_and_keeps_the_kernel_suffix(fed: RunningCollector) -> None:
    lines = get(fed, "/api/v1/profile", query=TRAINER_Q, format="folded").decode().splitlines()
    assert f"main;{ENGINE};{LLVM} 30" in lines
    assert f"main;{ENGINE};{WRAP} 20" in lines
    assert f"main;{WRAP};do_syscall_64_[k] 10" in lines
    assert f"main;{RUST} 10" in lines  # folded text has no identity but the text: the two merge
    assert not any("_Z" in line for line in lines)


def test_json_tree_names_are_demangled_with_the_raw_name_beside(fed: RunningCollector) -> None:
    root = fed.json("/api/v1/profile", since="10m", query=TRAINER_Q)["root"]
    (main,) = root["children"]
    children = {c.get("system_name", c["name"]): c for c in main["children"]}
    assert children[ENGINE_RAW]["name"] == ENGINE and children[ENGINE_RAW]["value"] == 50
    assert (children[RUST_A]["name"], children[RUST_B]["name"]) == (RUST, RUST)
    assert "system_name" not in main


def test_svg_and_html_flame_graphs_show_demangled_names(fed: RunningCollector) -> None:
    svg = ET.fromstring(get(fed, "/api/v1/profile", query=TRAINER_Q, format="svg"))
    ns = "{http://www.w3.org/2000/svg}"
    titles = [t.text or "" for t in svg.iter(f"{ns}title")]
    for name in (ENGINE, LLVM, WRAP, RUST):
        assert any(t.startswith(f"{name} (") for t in titles), name
    assert ENGINE in [t.text for t in svg.iter(f"{ns}text")]  # the frame's label
    assert "_ZN" not in ET.tostring(svg, encoding="unicode")
    html = get(fed, "/api/v1/profile", query=TRAINER_Q, format="html").decode()
    data = json.loads(html.split('id="fp-data">', 1)[1].split("</script>", 1)[0].replace("<\\/", "</"))
    assert {ENGINE, LLVM, WRAP, RUST} <= set(data["names"]) and LLVM_RAW not in data["names"]


def test_speedscope_and_grafana_frames_are_demangled(fed: RunningCollector) -> None:
    speedscope = json.loads(get(fed, "/api/v1/profile", query=TRAINER_Q, format="speedscope"))
    frames = Counter(f["name"] for f in speedscope["shared"]["frames"])
    assert frames[ENGINE] == 1 and frames[LLVM] == 1 and frames[RUST] == 2  # two functions, one name
    grafana = json.loads(get(fed, "/api/v1/profile", query=TRAINER_Q, format="grafana"))
    labels = grafana["data"]["values"][-1]
    assert {ENGINE, LLVM, WRAP, "do_syscall_64_[k]"} <= set(labels) and labels.count(RUST) == 2


def test_grafana_pyroscope_flame_graph_names_are_demangled(fed: RunningCollector) -> None:
    fg = merge(fed, selector=TRAINER_Q, kind=SAMPLES).flamegraph
    paths = nodes(fg)
    assert paths[("total", "main", ENGINE, LLVM)] == (30, 30)
    assert paths[("total", "main", WRAP, "do_syscall_64_[k]")] == (10, 10)
    assert not any(n.startswith("_Z") for n in fg.names)
    req = querier_pb2.SelectMergeProfileRequest(
        profile_typeID=CPU, label_selector=TRAINER_Q, start=now_ms() - 600_000, end=now_ms() + 60_000
    )
    prof = call(fed, "SelectMergeProfile", req, profile_pb2.Profile)
    strings = prof.string_table
    assert (LLVM_RAW, LLVM) in {(strings[f.system_name], strings[f.name]) for f in prof.function}


def test_pprof_names_functions_demangled_and_keeps_the_raw_system_name(
    fed: RunningCollector, tmp_path: Path
) -> None:
    body = get(fed, "/api/v1/profile", query=TRAINER_Q, format="pprof")
    path = tmp_path / "cpu.pb.gz"
    path.write_bytes(body)
    profile = profile_pb2.Profile.FromString(gzip.decompress(body))
    strings = profile.string_table
    functions = {strings[f.system_name]: strings[f.name] for f in profile.function}
    assert functions[LLVM_RAW] == LLVM and functions[ENGINE_RAW] == ENGINE and functions[WRAP_RAW] == WRAP
    assert functions[RUST_A] == functions[RUST_B] == RUST  # two functions
    assert functions["main"] == "main" and functions["do_syscall_64"] == "do_syscall_64"
    top = pprof(path, "-top", "-nodecount=20")
    assert LLVM in top and ENGINE in top and "_ZN" not in top
    raw = pprof(path, "-raw")
    assert f"{LLVM} libLLVM.so" in raw and f"({LLVM_RAW})" in raw


def test_diff_views_are_demangled(fed: RunningCollector) -> None:
    q = {"query": TRAINER_Q, "query2": LOADER_Q}
    rows = json.loads(get(fed, "/api/v1/diff", **q))["functions"]
    by_raw = {r.get("system_name", r["function"]): r for r in rows}
    assert by_raw[LLVM_RAW]["function"] == LLVM and by_raw[WRAP_RAW]["function"] == WRAP
    assert by_raw[RUST_A]["function"] == by_raw[RUST_B]["function"] == RUST
    svg = get(fed, "/api/v1/diff", format="svg", **q).decode()
    assert f"{WRAP} (libc10.so)" in svg and "_ZN" not in svg
    grafana = json.loads(get(fed, "/api/v1/diff", format="grafana", **q))
    assert {LLVM, WRAP, "do_syscall_64_[k]"} <= set(grafana["data"]["values"][-1])


def test_fleetprof_top_prints_demangled_names_and_a_kernel_column(fed: RunningCollector) -> None:
    r = fleetprof("top", "--collector", fed.url, "--query", TRAINER_Q, "--since", "5m", "--limit", "10")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].split() == ["SELF%", "SELF", "TOTAL%", "TOTAL", "FUNCTION"]
    rows = {line.split(None, 4)[4]: line for line in lines[2:]}
    assert f"{LLVM}  [libLLVM.so]" in rows
    assert f"{WRAP}  [libc10.so]" in rows
    assert "do_syscall_64  [kernel]" in rows
    assert "_[k]" not in r.stdout and "_ZN" not in r.stdout
