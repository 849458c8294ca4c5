"""The compile stack's accounting (kiln/compilation/monitor.py): the part of the compile state
since a point, and a speculative draft's section taken out of it, cache directories included."""
import pytest

from kiln.compilation import monitor


def _state(n, events, opens, inductor, sections=()):
    return {"counters": {"num_inductor_compiles": n}, "pass_runs": [f"run{e}" for e in events],
            "events": list(events), "cache_opens": list(opens), "cache_dirs": dict(opens),
            "inductor_cache_dir": inductor, "trace_s": n, "compile_s": 2 * n, "load_s": 0,
            "sections": list(sections)}


@pytest.mark.parametrize("from_start", [False, True])  # in this process / a rank's own
def test_split_section_takes_a_drafts_part_out_of_the_compile_state(from_start):
    before = _state(1, [0], [("old", "miss")], "old/ind")
    start = _state(3, [0, 1, 2], [("old", "miss"), ("t", "miss")], "t/ind")
    end = _state(5, [0, 1, 2, 3, 4], [("old", "miss"), ("t", "miss"), ("d", "miss")], "d/ind")
    after = _state(6, [0, 1, 2, 3, 4, 5], end["cache_opens"], "d/ind",
                   [{"name": "draft", "start": start, "end": end}])
    target, draft = monitor.split_section(after, None if from_start else before, "draft")
    assert draft["counters"] == {"num_inductor_compiles": 2} and draft["events"] == [3, 4]
    assert draft["pass_runs"] == ["run3", "run4"] and list(draft["cache_dirs"]) == ["d"]
    assert draft["compile_s"] == 4 and draft["inductor_cache_dir"] == "d/ind"
    assert target["events"] == ([0] if from_start else []) + [1, 2, 5]
    assert target["counters"] == {"num_inductor_compiles": 4 if from_start else 3}
    assert list(target["cache_dirs"]) == (["old"] if from_start else []) + ["t"]
    assert target["inductor_cache_dir"] == "t/ind" and "sections" not in target
    assert monitor.split_section(after, after, "draft")[1] is None  # none recorded since


def test_a_cache_opened_again_in_this_process_is_listed_again():
    """A second start-up in one process (a second in-process `kiln compile`) opens the cache
    directories the first did, warm now: its part lists them as hits."""
    first = [("t", "miss"), ("d", "miss")]
    before = _state(2, [0, 1], first, "d/ind")
    start = _state(2, [0, 1, 2], [*first, ("t", "hit")], "t/ind")
    end = _state(2, [0, 1, 2, 3], [*first, ("t", "hit"), ("d", "hit")], "d/ind")
    after = {**end, "events": [0, 1, 2, 3, 4],
             "sections": [{"name": "draft", "start": start, "end": end}]}
    assert monitor.state_since(end, before)["cache_dirs"] == {"t": "hit", "d": "hit"}
    target, draft = monitor.split_section(after, before, "draft")
    assert target["cache_dirs"] == {"t": "hit"} and draft["cache_dirs"] == {"d": "hit"}
