"""Serve the pools behind an OpenAI-compatible HTTP API: `python -m experiments.server [overrides]`.

The same config groups as experiments.run (model, cluster, scheduler, transfer, router, fault, and
`layout`), plus `serve` (conf/serve/default.yaml): the pools start on Ray (embedded, or
`cluster.address`), then uvicorn serves /v1/completions, /v1/chat/completions, /v1/models, /health and
/metrics at serve.host:serve.port. SIGINT or SIGTERM drains: no new connections, requests in flight
get serve.drain_timeout_s to finish, the rest fail, then the pools are released. The run directory
holds config.yaml, requests.jsonl and steps.jsonl (pdlab's own records of each request and each
worker step, as experiments.run writes them) and metrics.json.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import hydra
import uvicorn
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from experiments.compose import exit_on_bad_overrides
from experiments.config import CONF_DIR, ConfigError, RunSpec, points, section
from experiments.serving.serve import engines_for, ensure_ray, request_row, step_row
from router.frontend import Frontend
from router.openai_api import build_app
from router.prom import OUTCOMES, ServeMetrics
from router.tokenizer import TextTokenizer, TokenizerError, load_tokenizer

log = logging.getLogger("pdlab")


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    tokenizer: str | None = None
    max_queue: int = 256
    retry_after_s: int = 1
    drain_timeout_s: float = 30.0
    record: bool = True
    steps_flush_s: float = 10.0
    access_log: bool = False

    def __post_init__(self):
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} must be in [0, 65536)")
        for key in ("max_queue", "retry_after_s"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key}={getattr(self, key)} must be >= 1")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s={self.drain_timeout_s} must be >= 0")
        if not self.steps_flush_s > 0:
            raise ValueError(f"steps_flush_s={self.steps_flush_s} must be > 0")


def parse_serve(cfg: DictConfig) -> tuple[RunSpec, ServeConfig, str, TextTokenizer | None]:
    """(the pools' spec, the front end's settings, the served model's name, its tokenizer or None);
    raises ConfigError naming the key."""
    raw = OmegaConf.to_container(cfg.serve, resolve=True) if cfg.get("serve") is not None else {}
    serve = section(ServeConfig, raw, "serve")
    rest = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "serve"])
    chosen = points(rest)
    if len(chosen) != 1:
        raise ConfigError(f"compare names {len(chosen)} layouts; a server serves one (give layout=...)")
    spec = chosen[0][2]
    name = serve.model_name or (Path(spec.model.checkpoint).name if spec.model.checkpoint else spec.model.model)
    key = "serve.tokenizer" if serve.tokenizer else "model.checkpoint"
    try:
        if serve.tokenizer is not None:
            tokenizer = TextTokenizer(serve.tokenizer)
        else:
            tokenizer = load_tokenizer(spec.model.checkpoint)
    except TokenizerError as e:
        raise ConfigError(f"{key}: {e}") from None
    if tokenizer is not None and tokenizer.vocab_size > spec.vocab_size:
        raise ConfigError(f"{key}: the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
                          f"vocabulary ({spec.vocab_size})")
    return spec, serve, name, tokenizer


class Server(uvicorn.Server):
    """uvicorn's server that drains the front end when told to stop, and gives signals back as they were."""

    def __init__(self, config: uvicorn.Config, frontend: Frontend, drain_timeout_s: float):
        super().__init__(config)
        self.frontend, self.drain_timeout_s = frontend, drain_timeout_s
        self.loop: asyncio.AbstractEventLoop | None = None
        self.num_failed_at_exit = 0

    def handle_exit(self, sig, frame) -> None:
        if self.loop is not None and not self.frontend.draining:
            self.frontend.draining = True
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        self.num_failed_at_exit = await self.frontend.drain(self.drain_timeout_s)

    def stop(self) -> None:
        """From any thread: drain and exit, as SIGTERM would."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.handle_exit, signal.SIGTERM, None)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


def make_server(router, tokenizer, serve: ServeConfig, model_name: str, on_end=None) -> Server:
    """The HTTP server over a started Router (its pool already up); `server.run()` blocks until it stops."""
    metrics = ServeMetrics()

    def ended(op, rec):
        metrics.ended(op.outcome, rec, op.num_tokens)
        if on_end is not None:
            on_end(op, rec)

    frontend = Frontend(router, tokenizer, serve.max_queue, serve.retry_after_s, on_end=ended)
    metrics.watch(router.pool, frontend)
    server: Server | None = None

    @asynccontextmanager
    async def lifespan(app):
        server.loop = asyncio.get_running_loop()
        frontend.start(server.loop)
        yield
        frontend.close()

    app = build_app(frontend, metrics, model_name, router.max_model_len, lifespan=lifespan)
    config = uvicorn.Config(app, host=serve.host, port=serve.port, log_level="warning", access_log=serve.access_log,
                            lifespan="on", timeout_graceful_shutdown=int(serve.drain_timeout_s) + 10)
    server = Server(config, frontend, serve.drain_timeout_s)
    server.metrics = metrics
    return server


class StepSink:
    """Collects the workers' step records every `every_s` seconds, taking them out of the workers
    (so a server that runs for days holds none), and appends them to steps.jsonl on the router's
    clock, as experiments.run writes them; with no file it only drains."""

    def __init__(self, router, path: Path | None, t0: float, every_s: float):
        self.router, self.t0, self.every_s = router, t0, every_s
        self.file = open(path, "w") if path is not None else None
        self.num_steps = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="steps", daemon=True)
        self._thread.start()

    def flush(self) -> None:
        for worker, steps in self.router.traces(drain=True).items():
            self.num_steps += len(steps)
            if self.file is not None:
                for st in steps:
                    self.file.write(json.dumps(step_row(worker, st, self.t0)) + "\n")
        if self.file is not None:
            self.file.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.flush()
            except Exception:                # a worker lost mid-call: the next round tries again
                log.exception("collecting step records failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.flush()
        finally:
            if self.file is not None:
                self.file.close()


def serve(spec: RunSpec, serve_cfg: ServeConfig, model_name: str, tokenizer, run_dir: Path | None) -> dict:
    from cluster.pool import WorkerPool
    from cluster.ray_cluster import stop_ray
    from router.router import Router

    rows_file = open(run_dir / "requests.jsonl", "w") if run_dir is not None and serve_cfg.record else None
    t0 = time.time()

    def record(op, rec):
        if rows_file is not None:
            row = request_row(rec, t0) | {"prompt_ids": rec.prompt_ids, "arrival_time": rec.arrival_s,
                                          "outcome": op.outcome, "kind": op.gen.kind}
            rows_file.write(json.dumps(row) + "\n")
            rows_file.flush()

    ensure_ray(spec)
    pool = WorkerPool(spec.cluster, spec.model, engines_for(spec), spec.transfer).start()
    router = sink = None
    try:
        router = Router(pool, spec.router, spec.transfer, spec.fault).start()
        sink = StepSink(router, run_dir / "steps.jsonl" if rows_file is not None else None, t0, serve_cfg.steps_flush_s)
        server = make_server(router, tokenizer, serve_cfg, model_name, on_end=record)
        text = "text and token-id prompts" if tokenizer else "token-id prompts only (no tokenizer.json)"
        chat = ", chat" if tokenizer is not None and tokenizer.chat_template else ""
        print(f"serving {model_name!r} on {pool.cfg.describe()} at http://{serve_cfg.host}:{serve_cfg.port}/v1 "
              f"({text}{chat}); Ctrl-C drains and stops", flush=True)
        server.run()
    finally:
        if sink is not None:
            sink.close()
        if router is not None:
            router.close()
        pool.shutdown()
        if spec.cluster.address is None:
            stop_ray()
        if rows_file is not None:
            rows_file.close()
    counts = {o: server.metrics.outcomes[o] for o in OUTCOMES}
    return {"model": model_name, "requests": counts, "failed_at_exit": server.num_failed_at_exit,
            "run_dir": None if run_dir is None else str(run_dir)}


def write_metrics(spec: RunSpec, run_dir: Path) -> dict | None:
    from experiments.serving.metrics import format_summary, summarize

    path = run_dir / "requests.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    if not rows:
        return None
    metrics = summarize(rows, spec.slo.ttft_ms, spec.slo.tpot_ms, spec.cluster.num_workers, spec.slo.attainment_target)
    (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(format_summary(metrics, title="pdlab serve (router clock)"))
    return metrics


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="serve")
def main(cfg: DictConfig) -> None:
    logging.getLogger("pdlab").setLevel(logging.INFO)
    try:
        spec, serve_cfg, name, tokenizer = parse_serve(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    summary = serve(spec, serve_cfg, name, tokenizer, run_dir)
    if serve_cfg.record:
        write_metrics(spec, run_dir)
    print(json.dumps(summary))


if __name__ == "__main__":
    exit_on_bad_overrides("serve")
    main()
