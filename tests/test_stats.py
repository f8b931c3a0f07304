"""Bootstrap intervals against hand-worked cases, and the comparison sentences chosen from them."""
import numpy as np
import pytest

from experiments.serving.compare import Estimate, best, change, ratio, sentence, verdict
from experiments.serving.stats import interval, median_ci, resample_counts, rng_for, separated, two_level


def test_resample_counts_are_draws_with_replacement():
    counts = resample_counts(5, 2000, np.random.default_rng(0))
    assert counts.shape == (2000, 5) and (counts.sum(axis=1) == 5).all()
    assert counts.mean(axis=0) == pytest.approx(np.ones(5), abs=0.06)   # each unit drawn once on average
    # P(a given unit is never drawn) = (4/5)^5 = 0.328
    assert (counts[:, 0] == 0).mean() == pytest.approx(0.8 ** 5, abs=0.03)
    assert resample_counts(0, 3, np.random.default_rng(0)).shape == (3, 0)


def test_interval_is_the_central_95_percent_of_replicates():
    assert interval(np.arange(101.0)) == pytest.approx((2.5, 97.5))
    assert interval([np.nan] * 60 + list(range(40))) is None       # most replicates undefined: no interval
    assert interval([3.0] * 10) == (3.0, 3.0)


def test_median_ci_of_three_values_is_their_range():
    # The median of 3 draws from {1, 2, 3} is 1 with probability 3*(1/3)^2*(2/3) + (1/3)^3 = 7/27 > 2.5 %,
    # so both tails of the percentile interval land on the extremes.
    assert median_ci([2.0, 1.0, 3.0]) == {"median": 2.0, "lo": 1.0, "hi": 3.0, "n": 3}
    assert median_ci([5.0]) == {"median": 5.0, "lo": None, "hi": None, "n": 1}
    assert median_ci([]) == {"median": None, "lo": None, "hi": None, "n": 0}
    assert median_ci([4.0, 4.0, 4.0, 4.0])["lo"] == 4.0


def test_median_ci_covers_the_true_median_about_95_percent_of_the_time():
    rng = np.random.default_rng(1)
    hits = 0
    for trial in range(200):
        ci = median_ci(rng.normal(10.0, 2.0, size=40), seed=trial)
        hits += ci["lo"] <= 10.0 <= ci["hi"]
    assert 0.88 <= hits / 200 <= 0.99


def test_two_level_without_within_run_noise_is_the_bootstrap_of_the_repeat_medians():
    # Repeats whose replicates are constant: only the draw of repeats varies. Two repeats 1 and 3: the
    # median of two draws is 1 (p 1/4), 2 (p 1/2) or 3 (p 1/4): the interval spans [1, 3].
    w = [[1.0] * 1000, [3.0] * 1000]
    assert two_level(w, np.random.default_rng(0)) == (1.0, 3.0)
    assert two_level([[7.0] * 1000], np.random.default_rng(0)) == (7.0, 7.0)


def test_two_level_with_one_repeat_is_its_within_run_interval():
    within = np.random.default_rng(2).normal(50.0, 5.0, size=1000)
    lo, hi = two_level([within], np.random.default_rng(3))
    ref_lo, ref_hi = interval(within)
    assert lo == pytest.approx(ref_lo, rel=0.03) and hi == pytest.approx(ref_hi, rel=0.03)


def test_two_level_is_wider_than_the_repeats_alone_when_runs_are_noisy():
    rng = np.random.default_rng(4)
    w = [rng.normal(m, 4.0, size=1000) for m in (10.0, 11.0, 12.0)]
    lo, hi = two_level(w, np.random.default_rng(5))
    assert lo < 10.0 and hi > 12.0


def test_seeded_streams_repeat_across_calls():
    assert rng_for("a", 1).integers(0, 1 << 30) == rng_for("a", 1).integers(0, 1 << 30)
    assert rng_for("a", 1).integers(0, 1 << 30) != rng_for("a", 2).integers(0, 1 << 30)


def test_separated():
    assert separated((1, 2), (3, 4)) == -1 and separated((3, 4), (1, 2)) == 1
    assert separated((1, 3), (2, 4)) == 0 and separated(None, (1, 2)) == 0 and separated((1, 2), (2, 3)) == 0


A, B, C = Estimate("A", 10.0, (9.0, 11.0)), Estimate("B", 20.0, (18.0, 22.0)), Estimate("C", 21.0, (19.0, 23.0))


def test_verdict_states_only_separated_differences():
    assert verdict([B, A]) == "A is lower than B (95% intervals separate)"
    assert verdict([A, B, Estimate("D", 30.0, (28.0, 32.0))]) == \
        "A is lowest, then B, then D (every pair's intervals separate)"
    assert verdict([A, B, C]) == "A is lower than B and C; no significant difference between B and C"
    assert verdict([B, C]) == "no significant difference between B and C (95% intervals overlap)"
    assert verdict([A, Estimate("E", None)]) == "nothing to compare; E: not compared (no value or no interval)"
    # A below C only; B overlaps both
    wide = Estimate("W", 15.0, (10.5, 19.5))
    assert verdict([A, wide, C]) == ("A is lower than C; no significant difference between A and W, "
                                     "or between W and C")


def test_separated_medians_within_two_percent_state_no_difference():
    # goodput that tracks the arrival rate: tight intervals a hair apart flip from run to run
    lo, hi = Estimate("P", 3.500, (3.499, 3.501)), Estimate("Q", 3.510, (3.505, 3.515))
    assert verdict([hi, lo]) == "no significant difference between P and Q (95% intervals overlap, or medians within 2%)"
    assert best([lo, hi]) is None and "no significant change" in change("goodput", lo, hi)
    far = Estimate("R", 3.80, (3.75, 3.85))                       # 8% above: stated
    assert verdict([lo, hi, far]) == ("P is lower than R; Q is lower than R; no significant difference between "
                                      "P and Q (intervals overlap or medians within 2%)")
    assert best([lo, hi, far]) == "R"


def test_sentence_shows_every_value_with_its_interval():
    text = sentence("ITL p99", [A, B], " ms")
    assert text == ("ITL p99 (median [95% CI]): A 10.0 ms [9.00, 11.0], B 20.0 ms [18.0, 22.0]: "
                    "A is lower than B (95% intervals separate).")


def test_change_says_rose_only_when_the_intervals_separate():
    assert change("ITL p99", A, B, " ms").startswith("ITL p99 rose from 10.0 ms [9.00, 11.0] (A) to")
    assert change("ITL p99", B, A, " ms").startswith("ITL p99 fell from")
    assert change("ITL p99", B, C, " ms").startswith("ITL p99 showed no significant change, from")


def test_ratio_flags_a_mixed_step_faster_than_decode_only():
    assert ratio("a 128-token chunk", 2.5, (2.2, 2.8)) == "a 128-token chunk took 2.50x [2.20, 2.80] a decode-only step"
    assert ratio("a 32-token chunk", 1.02, (0.97, 1.08)).endswith("no significant difference from one")
    text = ratio("a 32-token chunk", 0.79, (0.7, 0.9), remeasured=3)
    assert "implausible (mixed step faster than decode-only): noise dominates; re-measured 3 times" in text


def test_headline_sentences_come_from_metrics_and_say_when_a_point_ran_once():
    from experiments.serving.compare import headline_sentences
    a = {"itl_ms": {"p99": 10.0}, "ci": {"itl_ms.p99": [9.0, 11.0]}, "repeats": {"num_ok": 3}}
    b = {"itl_ms": {"p99": 20.0}, "ci": {"itl_ms.p99": [18.0, 22.0]}}
    lines = headline_sentences([("A", a), ("B", b)])
    assert lines[0] == ("ITL p99 (median [95% CI]): A 10.0 ms [9.00, 11.0], B 20.0 ms [18.0, 22.0]: "
                        "A is lower than B (95% intervals separate).")
    assert len(lines) == 2 and lines[1].startswith("B: served once; with one repeat an interval covers")
    assert headline_sentences([("A", a), ("C", a | {"repeats": {"num_ok": 2}})])[-1].startswith("ITL p99")
