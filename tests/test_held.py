"""The held files' policy on a clock of its own: a stable set that a new workload still
replaces once the old one's files have gone unopened for HELD_IDLE_SECONDS; and the table
under it, checked against a dict."""

from __future__ import annotations

import random

from cachefs.mirror.held import ENTRY_BYTES, HELD_IDLE_SECONDS, SWEEP_SLOTS, HeldFiles


def held_files(max_files: int) -> tuple[HeldFiles, list[float]]:
    now = [1000.0]
    return HeldFiles(max_files, clock=lambda: now[0]), now


def hold(held: HeldFiles, key: int) -> list[tuple[int, int]] | None:
    room = held.room_locked(key)
    if room is not None:
        room += held.put_locked(key, key * 10)
    return room


def test_full_held_files_take_no_file_while_theirs_are_opened():
    held, now = held_files(3)
    assert [hold(held, key) for key in (1, 2, 3)] == [[], [], []]
    for _ in range(100):  # epochs of 10 files, 3 held: the same 3 every time
        now[0] += HELD_IDLE_SECONDS / 24
        for key in range(1, 11):
            if held.get_locked(key) is None:
                assert hold(held, key) is None
    assert len(held) == 3 and all(held.holds_locked(key, key * 10) for key in (1, 2, 3))


def test_a_file_unopened_for_the_idle_time_makes_room_for_a_new_one():
    held, now = held_files(2)
    hold(held, 1), hold(held, 2)
    now[0] += 100
    held.get_locked(2)
    assert hold(held, 3) is None
    now[0] = 1000.0 + HELD_IDLE_SECONDS  # 1 idle for that long, 2 not
    assert hold(held, 3) == [(1, 10)]
    assert hold(held, 4) is None
    now[0] += 100
    assert hold(held, 4) == [(2, 20)]
    assert len(held) == 2 and held.holds_locked(3, 30) and held.holds_locked(4, 40)


def test_a_full_sweep_without_an_idle_file_stops_the_search_until_one_can_be():
    held, now = held_files(5000)
    for key in range(5000):
        hold(held, key)
    sweeps = 0
    while held._none_idle_until == 0:  # every file opened within the idle time
        assert hold(held, 10**6) is None
        sweeps += 1
    assert sweeps * SWEEP_SLOTS >= held._slots  # one whole round, SWEEP_SLOTS an open
    hand = held._hand
    now[0] += HELD_IDLE_SECONDS - 1
    assert hold(held, 10**6) is None and held._hand == hand  # nothing swept meanwhile
    now[0] += 1
    assert hold(held, 10**6) is not None and held.holds_locked(10**6, 10**7)


def test_a_lowered_bound_pushes_out_the_least_recently_opened():
    held, now = held_files(4)
    for key in (1, 2, 3, 4):
        hold(held, key)
        now[0] += 10
    held.get_locked(1)
    held.max_files = 2
    assert hold(held, 4) == [(4, 40), (2, 20), (3, 30)]  # replaced, then two let go
    assert len(held) == 2 and held.drop_locked(1) == 10 and len(held) == 1


def test_the_table_agrees_with_a_dict_through_growth_and_removals():
    held, now = held_files(10**6)
    model: dict[int, int] = {}
    rng = random.Random(7)
    keys = [rng.getrandbits(64) for _ in range(3000)] + [0, 2**64 - 1]
    keys += [k ^ 1 for k in keys[:500]]  # neighbours in the table
    for step in range(40000):
        key = rng.choice(keys)
        action = rng.random()
        if action < 0.5:
            packed = rng.getrandbits(8 * ENTRY_BYTES)
            assert held.room_locked(key) == []
            held.put_locked(key, packed)
            model[key] = packed
        elif action < 0.75:
            assert held.drop_locked(key) == model.pop(key, None)
        else:
            assert held.get_locked(key) == model.get(key)
        if step % 5000 == 0:
            assert all(held.get_locked(k) == v for k, v in model.items())
    assert len(held) == len(model) and held._slots > 1024  # grown
    assert all(held.holds_locked(k, v) for k, v in model.items())
