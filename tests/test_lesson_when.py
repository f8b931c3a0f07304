"""The lesson's goodput-against-rate sentence names what the curves show, ties included; the measured
breakdown names the part that grew most only where its interval says so."""
import numpy as np
import pytest

from experiments.lesson import rates
from experiments.lesson.when import _breakdown, most_load


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


def test_knee_breakdown_and_the_part_that_grew_most():
    assert rates.knee([1, 2, 4, 8], [True, True, False, True]) == {"last_met": 2, "falls_below": 4}
    assert rates.knee([1, 2], [False, True]) == {"last_met": None, "falls_below": 1}
    assert rates.knee([1, 2], [True, True]) == {"last_met": 2, "falls_below": None}
    dis = [{"status": "ok", "queue_s": 0.01, "prefill_s": 0.02, "exposed_transfer_s": 0.03, "handoff_s": 0.05,
            "decode_s": 0.2}, {"status": "failed", "queue_s": 9.0}]
    col = [{"status": "ok", "queue_s": 0.01, "prefill_s": 0.02, "exposed_transfer_s": None, "handoff_s": None,
            "decode_s": 0.2}]
    b = rates.breakdown(dis)
    assert b["num_requests"] == 1 and b["dominant"] == "decode" and b["dominant_before_decode"] == "exposed_transfer"
    assert b["mean_ms"]["exposed_transfer"] == pytest.approx(30.0) and b["mean_ms"]["handoff"] == pytest.approx(20.0)
    a = rates.against(b, rates.breakdown(col))
    assert a["grew_most"] == "exposed_transfer" and a["total_extra_ms"] == pytest.approx(50.0)
    assert rates.against(rates.breakdown([]), b)["grew_most"] is None


def _rows(n, rng, **means_ms):
    """n completed requests whose parts scatter around `means_ms` (ms)."""
    keys = {"queue": "queue_s", "prefill": "prefill_s", "exposed_transfer": "exposed_transfer_s", "decode": "decode_s"}
    rows = []
    for _ in range(n):
        r = {"status": "ok", "handoff_s": 0.0}
        for part, key in keys.items():
            r[key] = max(0.0, rng.normal(means_ms.get(part, 1.0), 0.5)) / 1e3
        r["handoff_s"] = r["exposed_transfer_s"]                # the transfer is the whole handoff
        rows.append(r)
    return rows


def test_the_measured_breakdown_names_the_part_that_grew_most_only_where_the_intervals_say_so():
    rng = np.random.default_rng(0)
    colo = [_rows(30, rng, prefill=10.0, decode=50.0) for _ in range(3)]
    clear = rates.measured_against([_rows(30, rng, prefill=10.0, exposed_transfer=20.0, decode=52.0)
                                    for _ in range(3)], colo)
    assert clear["grew_most"] == "exposed_transfer" and clear["grew_most_among"] == ["exposed_transfer"]
    lo, hi = clear["extra_ci"]["exposed_transfer"]
    assert lo < clear["extra_ms"]["exposed_transfer"] < hi and lo > 15
    text = _breakdown(clear, "here")
    assert "the part that grew most against colocated is **exposed KV transfer**" in text
    lo, hi = clear["total_extra_ci"]
    assert lo > 0 and f"ms more, 95% interval of the difference [{lo:.1f}, {hi:.1f}] ms" in text
    assert "95% intervals over repeats and requests" in text
    one = rates.measured_against([_rows(30, rng, exposed_transfer=20.0)], colo[:1])
    assert "95% intervals over requests (one repeat)" in _breakdown(one, "here")

    close = rates.measured_against([_rows(30, rng, prefill=10.0, exposed_transfer=6.0, decode=55.0)
                                    for _ in range(3)], colo)      # both grew by 5 ms
    assert close["grew_most"] is None and set(close["grew_most_among"]) == {"exposed_transfer", "decode"}
    text = _breakdown(close, "here")
    assert "cannot be told apart among" in text and "exposed KV transfer" in text and "decode steps" in text
    same = rates.measured_against(colo[:2], colo[1:])              # the same requests on both sides, shuffled
    assert same["total_extra_ci"][0] < 0 < same["total_extra_ci"][1] and "(no different: " in _breakdown(same, "here")
    assert rates.measured_against([], colo)["grew_most"] is None
