"""A real load generator against `pdlab serve` (experiments.server), beside experiments.run serving the same workload.

    pdlab bench serve [--guidellm PATH] [--layouts 1p1d,colocated-chunked] [--rate 4]
                      [--num-requests 64] [--prompt-tokens 128] [--output-tokens 32] [--repeats 2]

For each layout, `--repeats` times interleaved: `python -m experiments.server` (tiny preset, a generated tokenizer as serve.tokenizer) is
driven by GuideLLM (Poisson arrivals, synthetic prompts, streaming /v1/completions, greedy); then the
requests it served (their token ids and arrival times, from the server's requests.jsonl) are replayed
by `python -m experiments.run workload=trace` on the same layout. Per request, the client's timings
(GuideLLM's JSON) are matched to the server's record by id. Printed: TTFT, TPOT and E2EL percentiles
from the client, from the server's records and from experiments.run's, the client/server ratios,
and where the client's extra time goes; then one JSON line.

GuideLLM's ITL is (last token - first token) / (tokens - 1) per request, which is what pdlab (and
vllm bench serve) call TPOT; its TPOT also counts the first token. The gaps between single tokens
(pdlab's ITL) are not in GuideLLM's output, so ITL is compared between the two pdlab runs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from experiments.serving.metrics import percentiles
from router import toy_tokenizer
from workers.config import preset

ROOT = Path(__file__).resolve().parent.parent
QUANTILES = ("p50", "p90", "p99")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server did not answer /health within {timeout_s} s")


def scenario(base: str, tokenizer: Path, out: Path, args) -> dict:
    return {"spec": {
        "backend": {"kind": "openai_http", "target": base, "model": "tiny", "request_format": "/v1/completions",
                    "extras": {"body": {"temperature": 0.0}}},
        "profile": {"kind": "poisson", "rate": args.rate},
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}],
        "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
        "constraints": [{"kind": "max_requests", "count": args.num_requests}],
        "seed": {"kind": "static", "value": 0},
        "outputs": [{"kind": "json", "path": str(out)}]}}


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def client_rows(path: Path) -> dict[str, dict]:
    """GuideLLM's successful requests by the server's response id: its own clock's timings, in seconds."""
    out = {}
    for r in json.loads(path.read_text())["benchmarks"][0]["requests"]["successful"]:
        t, n = r["info"]["timings"], r["output_metrics"]["text_tokens"]
        start, first, last = t["request_start"], t["first_token_iteration"], t["last_token_iteration"]
        out[r["response_id"]] = {"start": start, "first": first, "last": last, "ttft_s": first - start,
                                 "e2e_s": last - start, "tpot_s": (last - first) / (n - 1) if n > 1 else None}
    return out


def stats(rows: list[dict]) -> dict:
    ms = lambda key: percentiles(1e3 * r[key] for r in rows if r.get(key) is not None)
    return {"ttft_ms": ms("ttft_s"), "tpot_ms": ms("tpot_s"), "e2el_ms": ms("e2e_s"),
            "itl_ms": percentiles(1e3 * g for r in rows for g in r.get("itl_s") or ())}


def step_stats(steps: list[dict]) -> dict:
    """The engines' own step times (ms): decode-only steps, and steps that carried prompt tokens."""
    ms = lambda rows: percentiles(1e3 * (st["end_s"] - st["start_s"]) for st in rows)
    return {"decode_ms": ms([st for st in steps if not st["num_prefill_tokens"]]),
            "prefill_ms": ms([st for st in steps if st["num_prefill_tokens"]])}


def bench_layout(layout: str, tokenizer: Path, out: Path, args) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve_dir, run_dir, gl_json = out / "serve", out / "run", out / "guidellm.json"
    server = subprocess.Popen([sys.executable, "-m", "experiments.server", f"serve.tokenizer={tokenizer}", f"layout={layout}",
                               f"serve.port={port}", f"hydra.run.dir={serve_dir}"], cwd=ROOT,
                              stdout=open(out / "serve.log", "w"), stderr=subprocess.STDOUT)
    try:
        wait_healthy(server, base)
        (out / "scenario.json").write_text(json.dumps(scenario(base, tokenizer, gl_json, args), indent=2))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        cpu, wall = _children_cpu_s(), time.monotonic()
        with open(out / "guidellm.log", "w") as log:
            subprocess.run([args.guidellm, "run", "--scenario", str(out / "scenario.json"),
                            "--disable-console-interactive"], check=True, stdout=log, stderr=subprocess.STDOUT,
                           env=env, timeout=args.num_requests / args.rate * 10 + 120)
        client_cores = (_children_cpu_s() - cpu) / (time.monotonic() - wall)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    served = [r for r in jsonl(serve_dir / "requests.jsonl") if r["status"] == "ok"]
    client = client_rows(gl_json)
    matched = [r for r in served if r["id"] in client]
    # the same requests again, from experiments.run: same prompts, output lengths and arrival gaps
    t0 = min(r["arrival_time"] for r in matched)
    trace = out / "trace.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": r["arrival_time"] - t0, "prompt_ids": r["prompt_ids"],
                                         "output_len": r["output_len"]}) + "\n"
                             for r in sorted(matched, key=lambda r: r["arrival_time"])))
    subprocess.run([sys.executable, "-m", "experiments.run", "workload=trace", f"workload.trace={trace}",
                    f"layout={layout}", "report=false", f"hydra.run.dir={run_dir}"], cwd=ROOT, check=True,
                   stdout=open(out / "run.log", "w"), stderr=subprocess.STDOUT)
    replayed = [r for r in jsonl(run_dir / "requests.jsonl") if r["status"] == "ok"]
    steps = {name: step_stats(jsonl(d / "steps.jsonl")) for name, d in (("serve", serve_dir), ("run", run_dir))}
    # where the client's time goes, per request: before the server's handler began (the record's arrival),
    # and after its tokens were stamped
    before = [r["arrival_time"] - client[r["id"]]["start"] for r in matched]
    after_first = [client[r["id"]]["first"] - (r["arrival_time"] + r["ttft_s"]) for r in matched]
    after_last = [client[r["id"]]["last"] - (r["arrival_time"] + r["e2e_s"]) for r in matched]
    return {"layout": layout, "client_cores": client_cores, "load_avg_1m": [load_before, os.getloadavg()[0]], "num_client": len(client), "num_matched": len(matched), "num_replayed": len(replayed),
            "client": stats([client[r["id"]] for r in matched]), "serve": stats(matched), "run": stats(replayed),
            "steps": steps,
            "overhead_ms": {"http_to_submit": percentiles(1e3 * x for x in before),
                            "first_token_to_client": percentiles(1e3 * x for x in after_first),
                            "last_token_to_client": percentiles(1e3 * x for x in after_last)}}


def table(res: dict) -> str:
    rows = [f"### {res['layout']} ({res['num_matched']} requests matched client to server, "
            f"{res['num_replayed']} replayed by experiments.run)", "",
            "| metric | GuideLLM (client) | server records | client / records | experiments.run records "
            "| run / serve |", "|---|---|---|---|---|---|"]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2EL"), ("itl_ms", "ITL")):
        for q in QUANTILES:
            c, s, r = (res[src][key][q] for src in ("client", "serve", "run"))
            fmt = lambda v: "n/a" if v is None else f"{v:.2f} ms"
            ratio = lambda a, b: "n/a" if a is None or b is None or not b else f"{a / b:.3f}"
            rows.append(f"| {name} {q} | {fmt(c)} | {fmt(s)} | {ratio(c, s)} | {fmt(r)} | {ratio(r, s)} |")
    o = res["overhead_ms"]
    rows += ["", "Client minus server, per request (p50 / p99): request sent -> server handler (the record's arrival) "
             f"{o['http_to_submit']['p50']:.2f} / {o['http_to_submit']['p99']:.2f} ms; first token stamped -> "
             f"client {o['first_token_to_client']['p50']:.2f} / {o['first_token_to_client']['p99']:.2f} ms; last "
             f"token {o['last_token_to_client']['p50']:.2f} / {o['last_token_to_client']['p99']:.2f} ms. "
             f"GuideLLM itself kept {res['client_cores']:.2f} of this machine's {os.cpu_count()} cores busy; "
             "load average {:.1f} before, {:.1f} after.".format(*res["load_avg_1m"])]
    st = res["steps"]
    rows += ["", "The engines' own step times (p50 / p90), the server vs experiments.run: decode-only "
             f"{st['serve']['decode_ms']['p50']:.2f} / {st['serve']['decode_ms']['p90']:.2f} ms vs "
             f"{st['run']['decode_ms']['p50']:.2f} / {st['run']['decode_ms']['p90']:.2f} ms; with prompt tokens "
             f"{st['serve']['prefill_ms']['p50']:.2f} / {st['serve']['prefill_ms']['p90']:.2f} ms vs "
             f"{st['run']['prefill_ms']['p50']:.2f} / {st['run']['prefill_ms']['p90']:.2f} ms."]
    return "\n".join(rows)


def spread(results: list[dict]) -> str:
    """Client / records ratios over every layout and repeat: the range of each percentile."""
    lines = [f"Client / server records over {len(results)} runs (min - max):"]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2el_ms", "E2EL")):
        parts = []
        for q in QUANTILES:
            ratios = [r["client"][key][q] / r["serve"][key][q] for r in results if r["serve"][key][q]]
            parts.append(f"{q} {min(ratios):.3f} - {max(ratios):.3f}")
        lines.append(f"  {name}: " + ", ".join(parts))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pdlab bench serve", description=__doc__.splitlines()[0])
    p.add_argument("--guidellm", default=shutil.which("guidellm") or "guidellm", help="the guidellm executable")
    p.add_argument("--layouts", default="1p1d,colocated-chunked")
    p.add_argument("--rate", type=float, default=4.0)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=f"outputs/serve_bench/{time.strftime('%Y-%m-%d/%H-%M-%S')}")
    args = p.parse_args(argv)
    out = Path(args.out)
    tokenizer = toy_tokenizer.save(out / "tokenizer", preset("tiny").vocab_size)
    results = []
    for repeat in range(args.repeats):          # interleaved: every layout once per repeat
        for layout in args.layouts.split(","):
            res = bench_layout(layout, tokenizer, out / f"{layout}-{repeat}", args) | {"repeat": repeat}
            print(table(res), flush=True)
            results.append(res)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    print(spread(results))
    summary = {"out": str(out), "layouts": [{
        "layout": r["layout"], "repeat": r["repeat"], "requests": r["num_matched"], "client_cores": r["client_cores"],
        **{f"{k}_{q}_client_over_serve": (r["client"][k][q] / r["serve"][k][q]) if r["serve"][k][q] else None
           for k in ("ttft_ms", "tpot_ms") for q in QUANTILES},
        **{f"{k}_{q}_run_over_serve": (r["run"][k][q] / r["serve"][k][q]) if r["serve"][k][q] else None
           for k in ("ttft_ms", "tpot_ms", "itl_ms") for q in QUANTILES}} for r in results]}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
