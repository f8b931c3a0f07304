"""The lesson's goodput-against-rate sentence names what the curves show, ties included."""
from experiments.lesson.when import most_load


def curve(name, last_met):
    return {"name": name, "last_met": last_met}


def test_the_mode_that_meets_the_highest_rate_is_named():
    assert most_load([curve("a", 4.0), curve("b", 6.0)]) == \
        "The most load within the target on these GPUs: b, up to 6.00 requests/s per GPU."


def test_modes_tied_at_the_highest_rate_are_all_named():
    assert most_load([curve("a", 4.0), curve("b", 6.0), curve("c", 6.0)]) == \
        "The most load within the target on these GPUs: b and c, up to 6.00 requests/s per GPU."


def test_all_modes_tied_says_none_carries_more():
    line = most_load([curve("a", 4.0), curve("b", 4.0)])
    assert line.startswith("Every mode meets the target up to 4.00") and "no mode carries more" in line


def test_no_mode_meeting_the_target_is_said():
    assert most_load([curve("a", None), curve("b", None)]) == "No mode meets the target at any rate tried."
