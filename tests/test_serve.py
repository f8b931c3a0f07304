"""experiments.server through the `openai` SDK: a live server per mode over a tiny save_pretrained checkpoint
with a generated tokenizer. Colocated runs as `python -m experiments.server` in its own process
(its own embedded Ray); disaggregated 1P+1D runs in this process on the session's Ray."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router import openai_protocol as api
from router import toy_tokenizer
from router.tokenizer import TextTokenizer
from tests.conftest import HF_CONFIGS, ROOT, make_hf_checkpoint

VOCAB = HF_CONFIGS["gqa"]["vocab_size"]
MAX_MODEL_LEN = HF_CONFIGS["gqa"]["max_position_embeddings"]
PROMPT = "the first people made water and fire . what did they do then ?"
OVERRIDES = ["scheduler.kv_cache_mb=8", "cluster.gpus=2"]
STARTUP_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    import urllib.error
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)


def metrics(base: str) -> dict:
    """{(name, labels...): value} of every sample on /metrics."""
    status, text = get(f"{base}/metrics")
    assert status == 200
    return {(s.name, *sorted(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def kv_used(base: str) -> dict:
    return {dict(k[1:])["worker"]: v for k, v in metrics(base).items() if k[0] == "pdlab_kv_blocks_used"}


def outcome(base: str, name: str) -> float:
    return metrics(base)[("pdlab_requests_total", ("outcome", name))]


def until(predicate, timeout_s: float = 15.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout_s} s")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve-ckpt")
    make_hf_checkpoint(directory, "gqa")
    toy_tokenizer.save(directory, VOCAB)
    return directory


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Greedy token ids of PROMPT from one in-process engine on the checkpoint."""
    from workers.config import EngineConfig
    from workers.engine import Engine
    from workers.request import SamplingParams
    from workers.weights import build_model

    tok = TextTokenizer(checkpoint)
    engine = Engine(build_model(checkpoint=checkpoint), EngineConfig(num_kv_blocks=64))
    req = engine.add_request("r", tok.encode(PROMPT), SamplingParams(max_tokens=12, ignore_eos=True))
    engine.run()
    return {"prompt_ids": tok.encode(PROMPT), "output_ids": req.output_ids, "tok": tok}


@pytest.fixture(scope="module")
def colocated_proc(checkpoint, tmp_path_factory):
    """`python -m experiments.server` started here; the colocated fixture waits until it answers."""
    port, run_dir = free_port(), tmp_path_factory.mktemp("serve-run")
    cmd = [sys.executable, "-m", "experiments.server", f"model.checkpoint={checkpoint}", "cluster.mode=colocated",
           "cluster.workers=1", "serve.max_queue=3", "serve.retry_after_s=2", f"serve.port={port}",
           "serve.steps_flush_s=0.5",
           f"hydra.run.dir={run_dir}", *OVERRIDES]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    proc.base, proc.run_dir = f"http://127.0.0.1:{port}", run_dir
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)


@pytest.fixture(scope="module")
def colocated(colocated_proc):
    def up():
        assert colocated_proc.poll() is None, f"experiments.server exited: {colocated_proc.stdout.read()}"
        try:
            return get(f"{colocated_proc.base}/health")[0] == 200
        except OSError:
            return False
    until(up, STARTUP_S, "experiments.server answering /health")
    return colocated_proc.base


@pytest.fixture(scope="module")
def disagg(checkpoint, ray_session, colocated_proc):
    """1 prefill + 1 decode worker over ZeroMQ, served from a thread of this process."""
    from hydra import compose, initialize_config_dir
    from cluster.pool import WorkerPool
    from router.router import Router
    from experiments.server import make_server, parse_serve

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose("serve", overrides=[f"model.checkpoint={checkpoint}", "layout=1p1d", f"serve.port={free_port()}",
                                          "serve.drain_timeout_s=0", *OVERRIDES])
    spec, serve_cfg, name, tok = parse_serve(cfg)
    pool = WorkerPool(spec.cluster, spec.model, spec.engines(), spec.transfer).start()
    router = Router(pool, spec.router, spec.transfer).start()
    server = make_server(router, tok, serve_cfg, name)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    until(lambda: server.started, 30, "the in-process server started")
    server.base, server.thread = f"http://127.0.0.1:{serve_cfg.port}", thread
    yield server
    server.should_exit = True
    thread.join(30)
    router.close()
    pool.shutdown()


MODES = ["colocated", "disagg"]


def base_of(request, mode) -> str:
    value = request.getfixturevalue(mode)
    return value if isinstance(value, str) else value.base


# -- tests --------------------------------------------------------------------------------------------
def test_models_and_health(colocated_proc, disagg, colocated, checkpoint):
    for base in (colocated, disagg.base):
        assert json.loads(get(f"{base}/health")[1])["status"] == "ok"
        models = client(base).models.list()
        assert [m.id for m in models.data] == [checkpoint.name]


@pytest.mark.parametrize("mode", MODES)
def test_completion_matches_the_engine_streamed_or_not(request, mode, reference, checkpoint):
    c, tok = client(base_of(request, mode)), reference["tok"]
    ref = reference["output_ids"]
    whole = c.completions.create(model=checkpoint.name, prompt=PROMPT, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.token_ids == ref and choice.finish_reason == "length"
    assert choice.text == tok.decode(reference["prompt_ids"][-5:] + ref)[len(tok.decode(reference["prompt_ids"][-5:])):]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(reference["prompt_ids"]), 12)
    chunks = list(c.completions.create(model=checkpoint.name, prompt=reference["prompt_ids"], max_tokens=12,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}))
    with_tokens = [ch for ch in chunks if ch.choices and ch.choices[0].token_ids]
    assert len(with_tokens) == 12, "one event per token"
    assert [t for ch in with_tokens for t in ch.choices[0].token_ids] == ref
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == choice.text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


@pytest.mark.parametrize("mode", MODES)
def test_chat_streamed_and_whole(request, mode, reference, checkpoint):
    c, tok = client(base_of(request, mode)), reference["tok"]
    messages = [{"role": "user", "content": "what did they do then ?"}]
    prompt_len = len(tok.encode(tok.render_chat(messages), add_special_tokens=False))
    whole = c.chat.completions.create(model=checkpoint.name, messages=messages, max_tokens=6, seed=7, temperature=0.8)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (prompt_len, 6)
    chunks = list(c.chat.completions.create(model=checkpoint.name, messages=messages, max_completion_tokens=6, seed=7,
                                            temperature=0.8, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.choices[0].message.content, \
        "the same seed samples the same tokens"


def test_stop_strings_and_stop_token_ids(colocated, reference, checkpoint):
    c, ref = client(colocated), reference["output_ids"]
    chunks = list(c.completions.create(model=checkpoint.name, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    pieces = [ch.choices[0].text for ch in chunks if ch.choices[0].token_ids]
    full = "".join(pieces)
    j = next(i for i in range(1, 12) if ref[i] not in ref[:i])   # a token not seen before it
    stop = pieces[j]
    cut = full.find(stop)
    k = next(n for n in range(1, 13) if len("".join(pieces[:n])) >= cut + len(stop))   # tokens until it shows
    r = c.completions.create(model=checkpoint.name, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[:cut]
    assert r.choices[0].token_ids == ref[:k] and r.usage.completion_tokens == k
    r = c.completions.create(model=checkpoint.name, prompt=PROMPT, max_tokens=12, temperature=0,
                             extra_body={"ignore_eos": True, "stop_token_ids": [ref[j]]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].token_ids == ref[:j + 1]
    assert r.choices[0].text == "".join(pieces[:j]), "the token that stopped it is not text"


@pytest.mark.parametrize("body, status, param", [
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"temperature": 1e-3}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"seed": -1}, 400, "seed"),
    ({"prompt": [1, 2, VOCAB]}, 400, "prompt"),
    ({"prompt": [1] * (MAX_MODEL_LEN + 1)}, 400, "prompt"),
    ({"max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ({"stop_token_ids": [VOCAB + 5]}, 400, "stop_token_ids"),
    ({"n": 2}, 400, "n"),
    ({"logprobs": 3}, 400, "logprobs"),
    ({"frobnicate": True}, 400, "frobnicate"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "no-such-model"}, 404, "model"),
])
def test_bad_requests_are_openai_errors_naming_the_field(colocated, checkpoint, body, status, param):
    import urllib.request
    payload = {"model": checkpoint.name, "prompt": "the first people", "max_tokens": 4} | body
    req = urllib.request.Request(f"{colocated}/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    err = json.loads(e.value.read())["error"]
    assert e.value.code == status and err["param"] == param and err["type"] == "invalid_request_error"
    assert param in err["message"] or status == 404


def test_sdk_raises_typed_errors(disagg, checkpoint):
    c = client(disagg.base)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model=checkpoint.name, prompt="the", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


def test_presets_without_a_tokenizer_take_token_ids_only():
    with pytest.raises(api.APIError) as e:
        api.parse_completion({"model": "tiny", "prompt": "some text"}, None, "tiny")
    assert e.value.status == 400 and e.value.param == "prompt" and "token-id prompts only" in e.value.message
    assert api.parse_completion({"model": "tiny", "prompt": [5, 6]}, None, "tiny").prompt_ids == [5, 6]
    with pytest.raises(api.APIError, match="no chat template"):
        api.parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "x"}]}, None, "tiny", 64)


@pytest.mark.parametrize("mode", MODES)
def test_disconnect_mid_stream_aborts_and_frees_kv(request, mode, checkpoint):
    base = base_of(request, mode)
    aborted = outcome(base, "aborted")
    stream = client(base).completions.create(model=checkpoint.name, prompt=[1, 7, 9], max_tokens=MAX_MODEL_LEN - 4,
                                             stream=True, extra_body={"ignore_eos": True})
    got = [next(iter(stream)) for _ in range(3)]
    assert all(ch.choices[0].token_ids for ch in got)
    assert max(kv_used(base).values()) > 0, "it holds KV while it streams"
    stream.close()
    until(lambda: outcome(base, "aborted") == aborted + 1, what="the request counted as aborted")
    until(lambda: not any(kv_used(base).values()), what="every worker's KV blocks free")
    assert outcome(base, "completed") >= 1


def test_non_streaming_client_that_leaves_is_aborted(disagg, checkpoint):
    base = disagg.base
    aborted = outcome(base, "aborted")
    body = json.dumps({"model": checkpoint.name, "prompt": [1, 2], "max_tokens": MAX_MODEL_LEN - 4,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        until(lambda: max(kv_used(base).values()) > 0, what="the request holding KV")
    until(lambda: outcome(base, "aborted") == aborted + 1, what="the request counted as aborted")
    until(lambda: not any(kv_used(base).values()), what="every worker's KV blocks free")


def test_metrics_count_outcomes_latencies_and_transfers(disagg):
    m = metrics(disagg.base)
    assert m[("pdlab_requests_total", ("outcome", "completed"))] >= 3
    assert m[("pdlab_time_to_first_token_seconds_count",)] == m[("pdlab_e2e_request_latency_seconds_count",)] >= 3
    assert m[("pdlab_inter_token_latency_seconds_count",)] > m[("pdlab_time_to_first_token_seconds_count",)]
    assert m[("pdlab_kv_transfers_total", ("direction", "sent"), ("worker", "prefill:0"))] == \
        m[("pdlab_kv_transfers_total", ("direction", "received"), ("worker", "decode:0"))] >= 3
    assert m[("pdlab_worker_alive", ("worker", "decode:0"))] == 1
    assert ("pdlab_preemptions_total", ("worker", "prefill:0")) in m and ("pdlab_requests_waiting",) in m


def test_full_admission_queue_answers_429_with_retry_after(colocated, checkpoint):
    c = client(colocated)
    overloaded = outcome(colocated, "overloaded")
    streams = [c.completions.create(model=checkpoint.name, prompt=[1, 2, 3], max_tokens=MAX_MODEL_LEN - 4,
                                    stream=True, extra_body={"ignore_eos": True}) for _ in range(3)]
    for s in streams:
        next(iter(s))
    with pytest.raises(openai.RateLimitError) as e:
        c.completions.create(model=checkpoint.name, prompt=[1, 2, 3], max_tokens=2)
    assert e.value.response.headers["Retry-After"] == "2" and "serve.max_queue=3" in e.value.message
    assert outcome(colocated, "overloaded") == overloaded + 1
    for s in streams:
        s.close()
    until(lambda: not any(kv_used(colocated).values()), what="the aborted streams' KV freed")
    assert c.completions.create(model=checkpoint.name, prompt=[1, 2, 3], max_tokens=2).usage.completion_tokens == 2


def test_shutdown_fails_what_is_left_when_the_drain_time_is_up(disagg, checkpoint):
    stream = client(disagg.base).completions.create(model=checkpoint.name, prompt=[1, 2], max_tokens=MAX_MODEL_LEN - 4,
                                                    stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    disagg.stop()                                   # serve.drain_timeout_s=0: fail it at once
    with pytest.raises(openai.APIError, match="shutting down"):
        for _ in it:
            pass
    disagg.thread.join(30)
    assert not disagg.thread.is_alive()


def test_sigterm_stops_accepting_finishes_in_flight_and_releases_the_pool(colocated_proc, colocated, checkpoint,
                                                                          reference):
    stream = client(colocated).completions.create(model=checkpoint.name, prompt=[1, 2], max_tokens=200, stream=True,
                                                  extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    colocated_proc.send_signal(signal.SIGTERM)

    def refused():
        try:
            get(f"{colocated}/health", timeout=1)
            return False
        except OSError:
            return True
    until(refused, 10, "new connections refused")
    rest = list(it)
    assert rest[-1].choices[0].finish_reason == "length" and sum(len(ch.choices[0].token_ids) for ch in rest) == 199
    out, _ = colocated_proc.communicate(timeout=60)
    assert colocated_proc.returncode == 0, out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["requests"]["completed"] >= 3 and summary["failed_at_exit"] == 0
    rows = [json.loads(line) for line in (colocated_proc.run_dir / "requests.jsonl").read_text().splitlines()]
    assert rows[-1]["output_len"] == 200 and rows[-1]["status"] == "ok"
    stopped = [r for r in rows if r["prompt_ids"] == reference["prompt_ids"] and r["finish_reason"] == "stop"]
    assert len(stopped) == 2 and all(r["status"] == "ok" for r in stopped), "stop string and stop token id"
    assert json.loads((colocated_proc.run_dir / "metrics.json").read_text())["num_completed"] >= 3
    # step records were collected from the worker as it ran, in pieces: every step once, in order
    steps = [json.loads(line) for line in (colocated_proc.run_dir / "steps.jsonl").read_text().splitlines()]
    assert [st["step"] for st in steps] == list(range(len(steps))) and len(steps) >= 200
    assert all(a["end_s"] <= b["start_s"] + 1e-6 for a, b in zip(steps, steps[1:]))


def test_detokenizer_holds_a_split_character_and_loses_nothing(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["plain words and a few more"], trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    text = TextTokenizer(tmp_path)
    ids = text.encode("words: wörld ünï 日本")
    assert len(ids) > len("words: wörld ünï 日本"), "multi-byte characters span several tokens"
    detok = text.detokenizer(ids[:2])
    pieces = [detok.add(i) for i in ids[2:]] + [detok.flush()]
    assert "".join(pieces) == text.decode(ids)[len(text.decode(ids[:2])):]
    assert not any("\ufffd" in p for p in pieces) and "" in pieces, "held, not sent broken"


def test_stop_matcher_finds_stops_across_pieces():
    from router.frontend import StopMatcher
    m = StopMatcher(("ab", "xyz"))                 # holds the last 2 characters: they may begin "xyz"
    assert m.feed("qqa") == ("q", False) and m.feed("c") == ("q", False) and m.feed("d") == ("a", False)
    assert m.feed("xy") == ("cd", False) and m.feed("zq") == ("", True)
    m = StopMatcher(("ab",))
    assert m.feed("xa") == ("x", False) and m.feed("by") == ("", True), "a stop split over two pieces"
    assert StopMatcher(()).feed("abc") == ("abc", False)
    m = StopMatcher(("end",))
    assert m.feed("the e") == ("the", False) and m.flush() == " e"
