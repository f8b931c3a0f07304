"""The lesson's controlled chunked-prefill experiment (experiments/lesson/controlled.py): episodes, rounds,
the timeline, and decodes renewed where the rounds would outgrow the model."""
import pytest

from workers.weights import build_model


def test_an_episode_counts_the_gaps_while_the_prompt_is_in():
    from experiments.lesson.controlled import Episode

    # steady 1 s gaps, the prompt in from 3 to 7 with a 3 s gap, then steady again
    ep = Episode("x", inject_s=3.0, first_token_s=7.0, decode_times={"d0": [1.0, 2.0, 3.0, 4.0, 7.0, 8.0, 9.0]})
    inside, before = ep.gaps()
    assert before == [1.0, 1.0] and inside == [1.0, 3.0]     # the gaps that overlap the prompt's time in
    m = ep.metrics()
    assert m["stall_ms"] == pytest.approx(3000.0) and m["ttft_ms"] == pytest.approx(4000.0)
    assert m["steady_ms"] == pytest.approx(1000.0)
    ep.window_end_s = 8.0                                          # disaggregated: closes at the decode side's step
    assert ep.gaps()[0] == [1.0, 3.0, 1.0] and ep.metrics()["ttft_ms"] == pytest.approx(4000.0)


def test_controlled_experiment_rows_and_timeline_follow_the_schedule():
    from experiments.lesson import controlled

    model = build_model(model="tiny", seed=0)
    res = controlled.run(model, [16, 64, "whole"], num_decodes=3, context=32, prompt_len=64, repeats=2, lead=2, tail=1)
    assert [r["setup"] for r in res["rows"]] == ["prefill_first", "chunk 16", "chunk 64", "chunk whole",
                                                  "disaggregated"]
    for r in res["rows"]:
        assert len(r["samples"]) == 2
        for key in ("stall_ms", "ttft_ms", "itl_p99_ms", "steady_ms"):
            med, lo, hi = r[key]
            assert lo <= med <= hi and med > 0, (r["setup"], key, r[key])
    tl = res["timeline"]
    assert set(tl) == {r["setup"] for r in res["rows"]}

    def during(setup):          # each decode's tokens after the arrival, up to the prompt's first token
        ep = tl[setup]
        return {len([t for t in ts if 0 < t <= ep["first_token_ms"] + 1e-9]) for ts in ep["decodes"].values()}
    assert during("prefill_first") == {0}          # the prompt's step runs alone: the decodes stall
    assert during("chunk 16") == {4}               # a decode token with each of the four chunks
    assert during("chunk whole") == {1}
    d = tl["disaggregated"]
    assert d["joined_ms"] >= d["first_token_ms"] and d["handoff_ms"] > 0 and d["prefill_ms"] > 0
    assert during("disaggregated") == {len([t for t in next(iter(d["decodes"].values()))
                                            if 0 < t <= d["first_token_ms"] + 1e-9])}
    more = controlled.run(model, [16, "whole"], num_decodes=2, context=16, prompt_len=64, repeats=2, max_extra=2,
                          disaggregated=False)
    assert 0 <= more["extra_rounds"] <= 2
    assert {len(r["samples"]) for r in more["rows"]} == {2 + more["extra_rounds"]}   # every setup each extra round
    with pytest.raises(ValueError, match="chunking_controlled.chunks"):
        controlled.run(model, [128], num_decodes=1, context=8, prompt_len=64, repeats=2)
    with pytest.raises(ValueError, match="at least 2 rounds"):
        controlled.run(model, [16], num_decodes=1, context=8, prompt_len=64, repeats=1)


def test_controlled_decodes_are_renewed_where_every_round_would_outgrow_the_model(monkeypatch):
    """Rounds whose decode tokens together exceed the model's positions beside the context and the
    prompt still run: the decodes are renewed at the context between episodes, never inside one."""
    from experiments.lesson import controlled

    model = build_model(model="tiny", seed=0)
    import dataclasses
    monkeypatch.setattr(model, "cfg", dataclasses.replace(model.cfg, max_position_embeddings=256))
    res = controlled.run(model, [16, "whole"], num_decodes=2, context=16, prompt_len=64, repeats=20,
                         disaggregated=False)
    assert res["renewed"]["chunk 16"] >= 1          # its episodes are the longest
    for r in res["rows"]:
        assert len(r["samples"]) == 20 and all(m["stall_ms"] is not None for m in r["samples"]), r["setup"]
    with pytest.raises(ValueError, match="tokens of one episode exceed"):
        controlled.run(model, [16], num_decodes=1, context=16, prompt_len=200, repeats=2)


def test_a_table_value_from_fewer_rounds_than_all_says_how_many():
    """An episode without a gap while the prompt was in has no stall; the row says its stall rests on the
    other rounds instead of passing their median off as every round's."""
    from experiments.lesson.stall import _row

    row = {"stall_ms": [5.0, 4.0, 6.0], "itl_p99_ms": [3.0, 2.0, 4.0], "ttft_ms": [9.0, 8.0, 10.0],
           "steady_ms": [1.0, 0.9, 1.1],
           "samples": [{"stall_ms": 5.0, "itl_p99_ms": 3.0, "ttft_ms": 9.0, "steady_ms": 1.0},
                       {"stall_ms": None, "itl_p99_ms": None, "ttft_ms": 8.5, "steady_ms": 1.0},
                       {"stall_ms": 6.0, "itl_p99_ms": 3.5, "ttft_ms": 9.5, "steady_ms": 1.1}]}
    cells = _row("chunk 16", row).split(" | ")
    assert cells[1].endswith("(2 of 3 rounds)") and cells[2].endswith("(2 of 3 rounds)")
    assert "rounds" not in cells[3] and "rounds" not in cells[4]
