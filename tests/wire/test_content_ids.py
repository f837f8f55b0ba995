"""Content ids cannot be forged across agents: with public frame ids, Wagner's generalised birthday attack
finds in well under a second a 16-frame stack whose id is a chosen victim stack's (shown here against the
unkeyed ids the collector used to compute). The collector's ids are keyed, so the forgery is just another
stack and the victim's samples keep their frames, in memory and in DuckDB; with a leaked key, ingest still
notices the clash and keeps the two apart. The key lives in the data directory: private, kept across
restarts (one stack stays one stack), its own per collector; a directory without one gets one, and its
old rows merge with the new ones."""

from __future__ import annotations

import hashlib
import os
import random
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest

from fleetprof._proto.v1 import ingest_pb2 as pb
from fleetprof.collector.ingest.decode import Decoder
from fleetprof.collector.ingest.service import IngestService
from fleetprof.collector.model.ids import (
    _POSITION_SEED,
    _U64,
    ContentIds,
    ContentKeyError,
    _mix,
    stack_ids_of,
)
from fleetprof.collector.model.profile import FrameKey, Stack
from fleetprof.collector.query.selector import parse_selector
from fleetprof.collector.store.durable import KEY_FILE, DurableStore, content_key
from fleetprof.collector.store.memory import MemoryStore
from tests.support.stores import open_durable
from tests.support.wire import BatchBuilder

Frames = Sequence[tuple[str, str]]  # (function, module), root first; all user-space frames
FrameIds = Callable[[list[str], list[str]], np.ndarray]  # functions, modules -> int64 ids

VICTIM: Frames = [
    (f, "/usr/bin/app")
    for f in (
        "_start", "__libc_start_main", "main", "run", "serve", "accept_loop", "handle", "parse_request",
        "route", "dispatch", "handler", "query_db", "execute", "plan", "scan_table", "read_page",
    )
]  # fmt: skip
DEPTH = len(VICTIM)
CANDIDATES = 10_000  # frame names tried per position
LEVEL_BITS = (13, 26, 39, 64)  # low bits of the sum zeroed after each of the k-tree's 4 merges (k = 16)
LEAKED_KEY = bytes(range(32))


def unkeyed_frame_ids(functions: list[str], modules: list[str]) -> np.ndarray:
    """Frame ids as the collector computed them before they were keyed (any agent could): blake2b-64 of
    b"F" function NUL module kernel-byte."""
    return np.array(
        [
            int.from_bytes(
                hashlib.blake2b(b"F" + f.encode() + b"\0" + m.encode() + b"\0", digest_size=8).digest(),
                "little",
                signed=True,
            )
            for f, m in zip(functions, modules, strict=True)
        ],
        dtype=np.int64,
    )


def collector_frame_ids(ids: ContentIds) -> FrameIds:
    """Frame ids under the collector's key: what an attacker who has the key computes."""
    return lambda functions, modules: ids.interned_frame_columns(
        functions, modules, [False] * len(functions)
    )[1]


def id_of(frames: Frames, frame_ids: FrameIds) -> int:
    """The stack's id with the public mixing (stack_ids_of) over `frame_ids`."""
    fids = frame_ids([f for f, _ in frames], [m for _, m in frames])
    return int(stack_ids_of(fids, np.array([len(frames)]))[0])


def terms(fids: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """What each frame adds to a stack's sum at its position (the mixing of collector/model/ids.py)."""
    return _mix(fids.view(_U64) ^ _mix((positions.astype(_U64) + _U64(1)) * _POSITION_SEED))


def _merge(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], bits: int):
    """Every pair (one from a, one from b) whose sum has its low `bits` bits zero: (sums, picks)."""
    (av, ap), (bv, bp) = a, b
    mask = _U64((1 << bits) - 1)
    want = (_U64(0) - bv) & mask  # a + b = 0 (mod 2**bits) when a's low bits are -b's
    order = np.argsort(want, kind="stable")
    keys = want[order]
    have = av & mask
    lo, hi = np.searchsorted(keys, have, "left"), np.searchsorted(keys, have, "right")
    n = hi - lo
    ia = np.repeat(np.arange(len(av)), n)
    ib = order[np.repeat(lo, n) + np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)]
    return av[ia] + bv[ib], np.hstack([ap[ia], bp[ib]])


def forge(victim: Frames, frame_ids: FrameIds, seed: int) -> list[tuple[str, str]]:
    """Wagner's k-tree (k = 16): a stack of DEPTH frames of the attacker's own naming whose sum, and so
    whose id, is the victim's, from CANDIDATES names per position and four rounds of merging lists
    pairwise on ever more low bits of the sum. Needs nothing but `frame_ids` and the public mixing."""
    rng = random.Random(seed)
    names: list[list[str]] = []
    nodes = []
    for p in range(DEPTH):
        salt = rng.getrandbits(48)
        fs = [f"evil_{salt:012x}_{p}_{c}" for c in range(CANDIDATES)]
        names.append(fs)
        values = terms(frame_ids(fs, ["/tmp/libevil.so"] * CANDIDATES), np.full(CANDIDATES, p))
        nodes.append((values, np.arange(CANDIDATES, dtype=np.int32)[:, None]))
    victim_ids = frame_ids([f for f, _ in victim], [m for _, m in victim])
    target = terms(victim_ids, np.arange(DEPTH)).sum(dtype=_U64)  # wraps, as the id's sum does
    values, picks = nodes[0]
    nodes[0] = (values - target, picks)  # then the 16 terms must sum to 0
    for bits in LEVEL_BITS:
        nodes = [_merge(nodes[i], nodes[i + 1], bits) for i in range(0, len(nodes), 2)]
    (sums, picks) = nodes[0]
    assert len(sums) and not sums.any(), "no forgery among these candidates: try another seed"
    return [(names[p][c], "/tmp/libevil.so") for p, c in enumerate(picks[0].tolist())]


def frame_keys(frames: Frames) -> Stack:
    return tuple(FrameKey(f, m) for f, m in frames)


def batch(frames: Frames, node: str, samples: int, seq: int = 1) -> pb.Batch:
    b = BatchBuilder(node, agent_id=f"agent-{node}", sequence=seq)
    b.sample(b.process(7, "app", {"pod": node}), b.stack(frames), samples)
    return b.build()


def victims_stacks(store, node: str = "victim") -> dict[Stack, int]:  # any ProfileStore
    """Every stack of `node`'s samples over all time (a durable store answers from DuckDB)."""
    return dict(store.select(parse_selector(f'{{node="{node}"}}'), 0, 4e9).stacks)


def durable(path: Path) -> DurableStore:
    return open_durable(path, background=False)


def attack(service: IngestService, forged: Frames) -> None:
    """The attacker's batch first, so its stack is the first under the id; then the victim's."""
    assert service.ingest(batch(forged, "attacker", 50))
    assert service.ingest(batch(VICTIM, "victim", 7))


# -- the attack, and why it fails ----------------------------------------------------------------------
def test_wagner_forges_an_unkeyed_stack_id_in_well_under_a_second() -> None:
    t0 = time.perf_counter()
    forged = forge(VICTIM, unkeyed_frame_ids, seed=1)
    took = time.perf_counter() - t0
    assert len(forged) == DEPTH and set(forged).isdisjoint(VICTIM)
    assert id_of(forged, unkeyed_frame_ids) == id_of(VICTIM, unkeyed_frame_ids)
    assert took < 5.0  # ~0.2 s: 16 lists of 10,000 names, not a 2**64 search


def test_a_stack_forged_on_public_ids_does_not_take_the_victims_id(tmp_path: Path) -> None:
    forged = forge(VICTIM, unkeyed_frame_ids, seed=1)
    ids = ContentIds()
    assert ids.stack_id(frame_keys(forged)) != ids.stack_id(frame_keys(VICTIM))
    memory = MemoryStore()
    service = IngestService(memory, ids=ids)
    attack(service, forged)
    assert victims_stacks(memory) == {frame_keys(VICTIM): 7}
    assert victims_stacks(memory, "attacker") == {frame_keys(forged): 50}
    assert service.stack_counts["collisions"] == 0  # not even a clash: the ids differ

    store = durable(tmp_path)
    attack(IngestService(store, ids=store.ids), forged)
    store.flush()
    assert victims_stacks(store) == {frame_keys(VICTIM): 7}
    assert store.counters["cold_queries"] and store.stats()["rows_stacks"] == 2
    store.close()


def test_with_a_leaked_key_ingest_still_keeps_the_victims_frames(tmp_path: Path) -> None:
    """Defence in depth: a forgery that does find the victim's id (the attacker has the key) gets a slot
    and a stand-in id of its own in ingest, counted as a collision; neither batch is refused."""
    (tmp_path / KEY_FILE).write_bytes(LEAKED_KEY)
    leaked = ContentIds(LEAKED_KEY)
    forged = forge(VICTIM, collector_frame_ids(leaked), seed=2)
    assert leaked.stack_id(frame_keys(forged)) == leaked.stack_id(frame_keys(VICTIM))
    memory = MemoryStore()
    service = IngestService(memory, ids=leaked)
    attack(service, forged)
    assert victims_stacks(memory) == {frame_keys(VICTIM): 7}
    assert victims_stacks(memory, "attacker") == {frame_keys(forged): 50}
    assert service.stack_counts["collisions"] == 1

    store = durable(tmp_path)
    service = IngestService(store, ids=store.ids)
    attack(service, forged)
    store.flush()
    assert service.stack_counts["collisions"] == 1
    assert victims_stacks(store) == {frame_keys(VICTIM): 7}
    assert victims_stacks(store, "attacker") == {frame_keys(forged): 50}
    assert store.stats()["rows_stacks"] == 2
    store.close()


def test_with_a_leaked_key_the_database_keeps_the_forgery_so_the_key_must_stay_private(
    tmp_path: Path,
) -> None:
    """What ingest's check cannot do: the stores keep the first content under an id. Once the forgery is
    in the database and the collector restarts (a fresh ingest), the victim's stack arrives under the
    same id and its samples read the attacker's frames. Only the key's secrecy prevents this."""
    (tmp_path / KEY_FILE).write_bytes(LEAKED_KEY)
    store = durable(tmp_path)
    forged = forge(VICTIM, collector_frame_ids(store.ids), seed=2)
    assert IngestService(store, ids=store.ids).ingest(batch(forged, "attacker", 50))
    store.close()
    store = durable(tmp_path)
    assert IngestService(store, ids=store.ids).ingest(batch(VICTIM, "victim", 7))
    store.flush()
    assert victims_stacks(store) == {frame_keys(forged): 7}
    store.close()


# -- the key ----------------------------------------------------------------------------------------
def test_the_key_is_private_kept_across_restarts_and_each_collectors_own(tmp_path: Path) -> None:
    one, other = tmp_path / "one", tmp_path / "other"
    store = durable(one)
    key = (one / KEY_FILE).read_bytes()
    assert len(key) == 32 and stat.S_IMODE(os.stat(one / KEY_FILE).st_mode) == 0o600
    assert IngestService(store, ids=store.ids).ingest(batch(VICTIM, "victim", 7))
    store.close()
    durable(other).close()  # another collector: its own key
    assert (other / KEY_FILE).read_bytes() != key

    store = durable(one)  # back to one's key: the same stack gets the same id
    assert (one / KEY_FILE).read_bytes() == key
    assert IngestService(store, ids=store.ids).ingest(batch(VICTIM, "victim", 5, seq=2))
    store.flush()
    assert store.stats()["rows_stacks"] == 1
    assert victims_stacks(store) == {frame_keys(VICTIM): 12}
    store.close()


def test_a_directory_without_a_key_gets_one_and_its_old_rows_merge_with_new_ones(tmp_path: Path) -> None:
    """As a directory from before keyed ids: its rows hold ids under no key of today. The same stack and
    label set stored before and after have two ids each, and queries merge them by content."""
    store = durable(tmp_path)
    assert IngestService(store, ids=store.ids).ingest(batch(VICTIM, "victim", 7))
    store.close()
    old_key = (tmp_path / KEY_FILE).read_bytes()
    (tmp_path / KEY_FILE).unlink()

    store = durable(tmp_path)
    assert (tmp_path / KEY_FILE).read_bytes() != old_key
    assert IngestService(store, ids=store.ids).ingest(batch(VICTIM, "victim", 5, seq=2))
    store.flush()
    assert store.stats()["rows_stacks"] == 2  # one stack, two ids
    assert victims_stacks(store) == {frame_keys(VICTIM): 12}
    grouped = store.group(parse_selector("{}"), 0, 4e9, ["node", "pod"])
    assert grouped.totals == {("victim", "victim"): 12}
    assert store.label_values("pod") == ["victim"]
    store.close()


def test_ids_are_a_function_of_content_and_key() -> None:
    stack, labels = frame_keys(VICTIM), (("node", "victim"), ("pod", "victim"))
    a, b, a_again = ContentIds(b"a" * 32), ContentIds(b"b" * 32), ContentIds(b"a" * 32)
    assert a.stack_id(stack) != b.stack_id(stack) and a.labels_id(labels) != b.labels_id(labels)
    assert (a_again.stack_id(stack), a_again.labels_id(labels)) == (a.stack_id(stack), a.labels_id(labels))
    assert ContentIds().key != ContentIds().key  # without a key, a random one each
    with pytest.raises(ContentKeyError, match="16 to 64 bytes, not 15"):
        ContentIds(b"a" * 15)


def test_a_key_file_that_is_not_a_key_stops_the_store_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE).write_bytes(b"short")
    with pytest.raises(ContentKeyError, match="holds 5 bytes, not a content-id key.*restore it from a"):
        durable(tmp_path)


def test_a_store_given_ids_under_another_key_stops_and_opens_again_with_its_own(tmp_path: Path) -> None:
    """The store checks, with its database open, that the ids it was given hold its directory's key (a
    second collector making the key at the same moment): a clear error, and nothing left open."""
    content_key(tmp_path)  # the directory's key
    ids = ContentIds()
    with pytest.raises(ContentKeyError, match="is not the key this store was given"):
        DurableStore(tmp_path, decode=Decoder(ids).decode_payload, ids=ids, background=False)
    store = durable(tmp_path)
    assert store.ids.key == (tmp_path / KEY_FILE).read_bytes()
    store.close()
