"""IdIndex answers columns of 64-bit ids exactly as a dict would, however ids were added, merged or remapped;
stack content ids are order- and length-sensitive and the same one at a time or in a column."""

from __future__ import annotations

import random

import numpy as np

from fleetprof.collector.model.id_index import IdIndex
from fleetprof.collector.model.ids import stack_id_of_frames, stack_ids_of


def test_lookups_match_a_dict_through_merges_and_remaps() -> None:
    rng = random.Random(5)
    index, truth = IdIndex(), {}
    for step in range(60):
        new = {rng.getrandbits(64) - (1 << 63): rng.randrange(1000) for _ in range(rng.randrange(1, 400))}
        new = {k: v for k, v in new.items() if k not in truth}
        index.add(np.array(list(new), dtype=np.int64), np.array(list(new.values()), dtype=np.int64))
        truth.update(new)
        asked = rng.sample(list(truth), min(len(truth), 300)) + [rng.getrandbits(63) for _ in range(50)]
        got = index.get(np.array(asked, dtype=np.int64)).tolist()
        assert got == [truth.get(k, -1) for k in asked], step
        if step == 30:  # values 0..999 -> keep the even ones, halved
            renumber = np.array([v // 2 if v % 2 == 0 else -1 for v in range(1000)], dtype=np.int64)
            index.remap(renumber)
            truth = {k: v // 2 for k, v in truth.items() if v % 2 == 0}
    assert len(index) == len(truth)
    keys, values = index.items()
    assert dict(zip(keys.tolist(), values.tolist(), strict=True)) == truth
    assert keys.tolist() == sorted(truth)


def test_a_large_index_answers_a_column_in_any_order_as_a_dict_does() -> None:
    # Past SORT_QUERIES_ABOVE keys the ids are looked up in sorted order and put back in theirs.
    rng = np.random.default_rng(7)
    n = IdIndex.SORT_QUERIES_ABOVE + 1000
    keys = rng.integers(-(2**63), 2**63 - 1, n, dtype=np.int64)
    index = IdIndex(keys, np.arange(n, dtype=np.int64))
    index.add(np.array([5, -5], dtype=np.int64), np.array([n, n + 1], dtype=np.int64))  # recent, not merged
    expect = dict(zip(keys.tolist(), range(n), strict=True)) | {5: n, -5: n + 1}
    asked = np.concatenate(
        [keys[rng.integers(0, n, 3000)], rng.integers(-(2**63), 2**63 - 1, 300, dtype=np.int64)]
    )
    asked = np.concatenate([asked, [5, -5, keys.max(), keys.min(), 2**63 - 1, -(2**63)], asked[:10]])
    rng.shuffle(asked)
    assert index.get(asked).tolist() == [expect.get(x, -1) for x in asked.tolist()]


def test_an_empty_index_holds_nothing() -> None:
    assert IdIndex().get(np.array([0, 1, -1], dtype=np.int64)).tolist() == [-1, -1, -1]


def test_stack_ids_depend_on_order_and_length_and_agree_with_the_column_form() -> None:
    stacks = [[1, 2, 3], [3, 2, 1], [1, 2], [], [1, 2, 3, 0], [0], [7] * 50]
    one_by_one = [stack_id_of_frames(s) for s in stacks]
    assert len(set(one_by_one)) == len(stacks)  # every order, prefix and padding differs
    column = stack_ids_of(np.array([f for s in stacks for f in s], dtype=np.int64), [len(s) for s in stacks])
    assert column.tolist() == one_by_one
    assert stack_id_of_frames([1, 2, 3]) == one_by_one[0]  # stable: a pure function of the frame ids
    assert 0 not in one_by_one
