"""engine/model/cpu.py's Faster: which way a one-row step runs (spinning and split, or sleeping and whole), by the steps' own times."""

from __future__ import annotations

from kvcli.engine.model.cpu import Faster


def run(ways: Faster, steps: int, time_of) -> list[bool]:
    """Picks of `steps` steps, each recorded with time_of(way, step)."""
    picked = []
    for i in range(steps):
        way = ways.pick()
        picked.append(way)
        ways.record(way, time_of(way, i))
    return picked


def tries(picked: list[bool], best: bool) -> list[int]:
    return [i + 1 for i, way in enumerate(picked) if way != best]


def test_each_way_once_then_the_faster_and_the_other_tried_ever_less_often():
    ways = Faster(every=4, most=16)
    picked = run(ways, 60, lambda way, _i: 0.07 if way else 0.10)
    assert picked[:2] == [True, False]
    assert tries(picked, True) == [2, 6, 14, 30, 46]  # gaps 4, 8, 16, then at most 16
    assert ways.best() is True


def test_the_other_way_winning_takes_over_at_once_without_its_older_times():
    ways = Faster(every=4, most=64)
    quiet = 20  # the first 20 steps: spinning wins; then a busy machine slows it fivefold
    picked = run(ways, 40, lambda way, i: (0.07 if i < quiet else 0.35) if way else 0.10)
    # two slow steps in a row (indexes 20 and 21) have the other way tried at the next; it wins and keeps running
    tried = quiet + 2
    assert picked[tried] is False
    assert all(way is False for way in picked[tried:tried + 3])
    assert 0.07 not in ways.times[True]  # the quiet machine's times went with the take-over
    assert ways.best() is False


def test_a_machine_going_quiet_is_found_by_the_next_try():
    ways = Faster(every=4, most=8)
    busy = 12  # spinning is slow for 12 steps, then fast
    picked = run(ways, 40, lambda way, i: (0.35 if i < busy else 0.07) if way else 0.10)
    later = [i for i in tries(picked, False) if i > busy]
    assert later, "spinning was never tried again"
    assert all(way is True for way in picked[later[0] - 1:later[0] + 3])  # the try won and took over at once


def test_noise_below_the_jump_does_not_trigger_tries():
    ways = Faster(every=4, most=1000)
    noise = [0.07, 0.08, 0.065, 0.09, 0.075, 0.1]  # at most 1.43x the running median
    picked = run(ways, 200, lambda way, i: noise[i % len(noise)] if way else 0.2)
    assert tries(picked, True) == [2, 6, 14, 30, 62, 126]


def test_a_lone_slow_step_is_noise_and_tries_nothing():
    ways = Faster(every=4, most=64)
    spiky = lambda way, i: (0.2 if i % 5 == 4 else 0.07) if way else 0.3  # noqa: E731  every 5th step is slow
    picked = run(ways, 120, spiky)
    assert tries(picked, True) == [2, 6, 14, 30, 62]


def test_three_ways_the_fastest_runs_and_the_others_are_tried_in_turn():
    ways = Faster(every=4, most=16, ways=("split", "whole", "sleep"))
    picked = run(ways, 40, lambda way, _i: {"split": 0.048, "whole": 0.045, "sleep": 0.066}[way])
    assert picked[:3] == ["split", "whole", "sleep"]
    assert ways.best() == "whole"
    others = [way for way in picked[3:] if way != "whole"]
    assert others and others == ["split", "sleep", "split", "sleep"][: len(others)]  # the one tried longest ago first
