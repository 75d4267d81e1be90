"""The held files' policy on a clock of its own: a stable set that a new workload still
replaces once the old one's files have gone unopened for HELD_IDLE_SECONDS."""

from __future__ import annotations

from cachefs.mirror.held import HELD_IDLE_SECONDS, MAX_TICKS, TICK_SECONDS, HeldFiles


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
        now[0] += TICK_SECONDS / 3
        for key in range(1, 11):
            if held.get_locked(key) is None:
                assert hold(held, key) is None
    assert len(held) == 3 and all(held.holds_locked(key, key * 10) for key in (1, 2, 3))


def test_a_file_unopened_for_the_idle_time_makes_room_for_a_new_one():
    held, now = held_files(2)
    hold(held, 1), hold(held, 2)
    for _ in range(2):  # 2 opened again, a marker after each open
        now[0] += TICK_SECONDS
        held.get_locked(2)
    assert hold(held, 3) is None
    now[0] = 1000.0 + TICK_SECONDS + HELD_IDLE_SECONDS  # 1 idle for longer, 2 not
    assert hold(held, 3) == [(1, 10)]
    assert hold(held, 4) is None
    now[0] += TICK_SECONDS
    assert hold(held, 4) == [(2, 20)]
    assert len(held) == 2 and held.holds_locked(3, 30) and held.holds_locked(4, 40)


def test_markers_stay_bounded_and_a_lowered_bound_pushes_out_the_least_recent():
    held, now = held_files(4)
    for key in (1, 2, 3, 4):
        hold(held, key)
    for _ in range(10 * MAX_TICKS):
        now[0] += TICK_SECONDS
        held.get_locked(4)
    assert len(held._ticks) <= MAX_TICKS and len(held) == 4
    held.max_files = 2
    assert hold(held, 4) == [(4, 40), (1, 10), (2, 20)]  # replaced, then two let go
    assert len(held) == 2 and held.drop_locked(3) == 30 and len(held) == 1
