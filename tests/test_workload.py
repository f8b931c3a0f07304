"""Workloads: seeded and reproducible, arrivals and lengths as configured, traces replayed, bad input named."""
import json

import numpy as np
import pytest
from omegaconf import OmegaConf

from experiments.workload import LengthSpec, WorkloadConfig, WorkloadError, build_workload, load_trace

CHAT = dict(prompt_len={"dist": "lognormal", "mean": 300, "sigma": 1.0, "min": 4, "max": 4096},
            output_len={"dist": "lognormal", "mean": 250, "sigma": 0.8, "min": 4, "max": 1024})


def build(seed=0, vocab_size=1000, max_model_len=8192, **kwargs):
    return build_workload(WorkloadConfig(**{**CHAT, **kwargs}), vocab_size, max_model_len, seed)


def gaps(requests):
    return np.diff([r.arrival_s for r in requests])


def lengths(requests):
    return [(len(r.prompt_ids), r.max_tokens) for r in requests]


def test_same_seed_same_workload_other_seed_differs():
    a, b, c = build(seed=1), build(seed=1), build(seed=2)
    assert a == b
    assert [r.id for r in a] == [f"r{i}" for i in range(64)]
    assert [r.arrival_s for r in a] != [r.arrival_s for r in c]
    assert lengths(a) != lengths(c)
    assert a[0].prompt_ids != c[0].prompt_ids


def test_first_request_at_zero_and_poisson_mean_gap_is_one_over_rate():
    reqs = build(num_requests=2000, rate=5.0)
    assert reqs[0].arrival_s == 0.0
    assert np.all(gaps(reqs) >= 0)
    assert gaps(reqs).mean() == pytest.approx(1 / 5.0, rel=0.10)


def test_gamma_burstier_than_poisson():
    def cv(g):
        return g.std() / g.mean()
    poisson = gaps(build(num_requests=2000, rate=5.0, arrival="poisson"))
    bursty = gaps(build(num_requests=2000, rate=5.0, arrival="gamma", burstiness=0.25))
    assert cv(poisson) == pytest.approx(1.0, abs=0.15)
    assert cv(bursty) > 1.5 * cv(poisson)
    assert bursty.mean() == pytest.approx(1 / 5.0, rel=0.15)   # same rate, only burstier


def test_fixed_arrivals_every_one_over_rate():
    reqs = build(num_requests=50, rate=4.0, arrival="fixed")
    assert gaps(reqs) == pytest.approx(np.full(49, 0.25), abs=1e-12)


def test_lognormal_lengths_have_the_spec_mean():
    spec = {"dist": "lognormal", "mean": 300, "sigma": 1.0, "min": 1, "max": 10**7}
    reqs = build(num_requests=4000, vocab_size=10, max_model_len=10**8, prompt_len=spec,
                 output_len={"dist": "lognormal", "mean": 50, "sigma": 0.5, "min": 1, "max": 10**6})
    prompt, output = np.array(lengths(reqs)).T
    assert prompt.mean() == pytest.approx(300, rel=0.10)
    assert output.mean() == pytest.approx(50, rel=0.10)


def test_lengths_clipped_to_bounds_and_to_max_model_len():
    reqs = build(num_requests=300, prompt_len={"dist": "uniform", "min": 10, "max": 20},
                 output_len={"dist": "lognormal", "mean": 30, "sigma": 1.5, "min": 5, "max": 40})
    prompt, output = np.array(lengths(reqs)).T
    assert prompt.min() >= 10 and prompt.max() <= 20 and set(prompt) == set(range(10, 21))
    assert output.min() == 5 and output.max() == 40        # sigma 1.5 hits both bounds
    reqs = build(num_requests=300, max_model_len=128, output_len={"dist": "fixed", "value": 100})
    assert all(p + m <= 128 and p >= 1 and m == 100 for p, m in lengths(reqs))
    reqs = build(num_requests=10, max_model_len=128, output_len={"dist": "fixed", "value": 500, "max": 500})
    assert lengths(reqs) == [(1, 127)] * 10                # the output is kept, the prompt gives way


def test_length_scale_halves_lengths():
    fixed = dict(prompt_len={"dist": "fixed", "value": 512}, output_len={"dist": "fixed", "value": 128})
    assert lengths(build(num_requests=5, length_scale=0.5, **fixed)) == [(256, 64)] * 5
    full, half = build(num_requests=500), build(num_requests=500, length_scale=0.5)
    assert [r.arrival_s for r in full] == [r.arrival_s for r in half]
    for (p, m), (hp, hm) in zip(lengths(full), lengths(half)):
        assert abs(hp - p / 2) <= 1 and abs(hm - m / 2) <= 1


def test_token_ids_within_vocab():
    ids = np.concatenate([r.prompt_ids for r in build(vocab_size=50)])
    assert ids.min() >= 0 and ids.max() <= 49 and len(set(ids.tolist())) == 50


def test_rate_and_arrival_change_no_length_or_token():
    a = build(rate=2.0)
    b = build(rate=16.0, arrival="gamma", burstiness=0.5)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in b]
    assert [(r.prompt_ids, r.max_tokens) for r in a] == [(r.prompt_ids, r.max_tokens) for r in b]


def write_trace(path, lines):
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def test_trace_replayed_sorted_with_its_ids_and_lengths(tmp_path):
    trace = write_trace(tmp_path / "trace.jsonl", [
        {"arrival_s": 2.0, "prompt_len": 40, "output_len": 10},
        {"arrival_s": 0.5, "prompt_ids": [7, 8, 9], "output_len": 4, "id": "given"},
        "",
        {"arrival_s": 1.0, "prompt_len": 6, "output_len": 2},
    ])
    cfg = WorkloadConfig(trace=trace, num_requests=100, rate=123.0)
    assert cfg.name == "trace"
    reqs = build_workload(cfg, 1000, 8192, seed=0)
    assert [r.arrival_s for r in reqs] == [0.5, 1.0, 2.0]
    assert [r.id for r in reqs] == ["given", "r1", "r2"]
    assert reqs[0].prompt_ids == [7, 8, 9]
    assert lengths(reqs) == [(3, 4), (6, 2), (40, 10)]
    assert build_workload(cfg, 1000, 8192, seed=0) == reqs
    capped = build_workload(WorkloadConfig(trace=trace, num_requests=2), 1000, 8192, seed=0)
    assert [r.id for r in capped] == ["given", "r1"]
    scaled = build_workload(WorkloadConfig(trace=trace, length_scale=0.5), 1000, 8192, seed=0)
    assert lengths(scaled) == [(3, 2), (3, 1), (20, 5)]    # given prompt_ids are never scaled
    assert lengths(build_workload(cfg, 1000, 32, seed=0))[2] == (22, 10)


@pytest.mark.parametrize("line,message", [
    ({"arrival_s": 0.0, "prompt_len": 4}, "missing field 'output_len'"),
    ({"prompt_len": 4, "output_len": 2}, "missing field 'arrival_s'"),
    ({"arrival_s": 0.0, "output_len": 2}, "missing field 'prompt_len'"),
    ('{"arrival_s": 0.0, "prompt_len": 4', "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ({"arrival_s": 0.0, "prompt_len": 0, "output_len": 2}, "prompt_len must be a positive integer"),
    ({"arrival_s": 0.0, "prompt_len": 2.5, "output_len": 2}, "prompt_len must be a positive integer"),
    ({"arrival_s": 0.0, "prompt_len": 4, "output_len": "8"}, "output_len must be a positive integer"),
    ({"arrival_s": -1.0, "prompt_len": 4, "output_len": 2}, "arrival_s must be a number >= 0"),
    ({"arrival_s": 0.0, "prompt_ids": [1, -2], "output_len": 2}, "prompt_ids must be a non-empty list"),
    ({"arrival_s": 0.0, "prompt_ids": [1, 2], "prompt_len": 3, "output_len": 2}, "prompt_ids has 2 ids"),
    ({"arrival_s": 0.0, "prompt_ids": [1, 1000], "output_len": 2}, r"prompt id 1000 is not a token id in \[0, 1000\)"),
    ({"arrival_s": 9.0, "prompt_len": 4, "output_len": 2, "id": "a"}, "id 'a' is used twice"),
])
def test_bad_trace_line_named_in_one_line(tmp_path, line, message):
    good = {"arrival_s": 0.0, "prompt_len": 4, "output_len": 2, "id": "a"}
    trace = write_trace(tmp_path / "trace.jsonl", [good, good | {"id": "b"}, line])
    with pytest.raises(WorkloadError, match=message) as err:
        build_workload(WorkloadConfig(trace=trace), 1000, 8192, seed=0)
    assert str(err.value).startswith(f"{trace} line 3: ") and "\n" not in str(err.value)


def test_missing_or_empty_trace_file(tmp_path):
    with pytest.raises(WorkloadError, match=r"trace file .*nope\.jsonl does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(WorkloadError, match="has no requests"):
        load_trace(write_trace(tmp_path / "empty.jsonl", [""]))


@pytest.mark.parametrize("kwargs,message", [
    ({"rate": 0}, "^rate=0 must be positive$"),
    ({"num_requests": 0}, "^num_requests=0 must be a positive integer$"),
    ({"num_requests": 2.5}, "^num_requests=2.5 must be"),
    ({"arrival": "x"}, r"^arrival='x': choose one of \['poisson', 'gamma', 'fixed'\]$"),
    ({"burstiness": -1.0}, "^burstiness=-1.0 must be positive$"),
    ({"length_scale": 0.0}, "^length_scale=0.0 must be positive$"),
    ({"prompt_len": {"dist": "lognormal", "sigma": -1}}, "^prompt_len.sigma=-1 must be >= 0$"),
    ({"prompt_len": {"dist": "lognormal", "mean": -3}}, "^prompt_len.mean=-3 must be positive$"),
    ({"output_len": {"dist": "zipf"}}, r"^output_len.dist='zipf': choose one of"),
    ({"output_len": {"min": 10, "max": 5}}, "^output_len.max=5 must be >= min=10$"),
    ({"output_len": {"value": 8, "min": 10}}, r"^output_len.value=8 is outside \[min=10, max=None\]$"),
    ({"prompt_len": {"mena": 3}}, "^prompt_len.mena: unknown key"),
])
def test_bad_config_names_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WorkloadConfig(**kwargs)


def test_config_accepts_omegaconf_nodes():
    node = OmegaConf.create({"prompt_len": {"dist": "uniform", "min": 3, "max": 9}})
    cfg = WorkloadConfig(prompt_len=node.prompt_len)
    assert cfg.prompt_len == LengthSpec(dist="uniform", min=3, max=9)


def test_lengths_are_bounded_by_the_model_s_context_not_a_constant():
    """No default cap: an 8,192-token prompt is a valid fixed length, and each request is fitted to
    the model's context (Llama-3-8B's 8,192: the prompt gives way to the output)."""
    spec = LengthSpec(value=8192)
    assert spec.max is None
    cfg = WorkloadConfig(num_requests=2, prompt_len=spec, output_len=LengthSpec(value=128))
    reqs = build_workload(cfg, vocab_size=100, max_model_len=8192, seed=0, token_ids=False)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in reqs] == [(8064, 128)] * 2
    reqs = build_workload(cfg, vocab_size=100, max_model_len=131072, seed=0, token_ids=False)
    assert [r.num_prompt_tokens for r in reqs] == [8192] * 2
    with pytest.raises(ValueError, match="uniform distribution needs an upper bound"):
        LengthSpec(dist="uniform", min=1)


def test_lengths_that_can_never_fit_the_context_warn_once_naming_their_keys(caplog):
    """Every request of a fixed 5,000 + 96 on a 4,096-token model is cut: said once, with the keys and what
    the requests become. A distribution whose tail is cut is ordinary fitting and says nothing."""
    from experiments.workload import cut_note

    cfg = WorkloadConfig(num_requests=3, prompt_len=LengthSpec(value=5000), output_len=LengthSpec(value=96))
    with caplog.at_level("WARNING", logger="experiments.workload"):
        for _ in range(2):
            reqs = build_workload(cfg, vocab_size=100, max_model_len=4096, seed=0, token_ids=False)
    assert [(r.num_prompt_tokens, r.max_tokens) for r in reqs] == [(4000, 96)] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "workload: prompt_len.value=5000 and output_len.value=96 need at least 5096 tokens a request, more than "
        "max_model_len=4096: every request is cut to fit (5000 + 96 tokens become 4000 + 96)"]
    assert cut_note(cfg, 8192) is None
    assert cut_note(WorkloadConfig(**CHAT), 1024) is None               # only its tail is cut
    low = WorkloadConfig(prompt_len={"dist": "lognormal", "mean": 3000, "min": 2000, "max": 8000},
                         output_len={"dist": "uniform", "min": 600, "max": 900}, length_scale=0.5)
    assert cut_note(low, 1200) == ("prompt_len.min=2000 and output_len.min=600 (x length_scale 0.5) need at least "
                                   "1300 tokens a request, more than max_model_len=1200: every request is cut to "
                                   "fit (1000 + 300 tokens become 900 + 300)")
