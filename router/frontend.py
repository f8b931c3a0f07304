"""Between the HTTP server's event loop and the Router's threads.

Admission (a bound on requests in flight, refusal while draining), one thread that follows every open
request through `Router.follow` and hands its new tokens to the event loop, and per request the
pieces of its answer: one per token, with its text (when the model ships a tokenizer), stop strings
matched on that text, and an abort when the reader goes away, so its KV is freed on the workers.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass

from router.openai_protocol import APIError, Generation, param_of
from router.records import RequestRecord, StreamUpdate

log = logging.getLogger(__name__)
FOLLOW_WAIT_S = 0.05


@dataclass(frozen=True)
class Piece:
    """What one token adds to an answer (`finish_reason` on the last piece only)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass(eq=False)
class Open:
    """An admitted request, from submit until its answer ends."""

    rid: str
    gen: Generation
    record: RequestRecord
    queue: asyncio.Queue
    seen: int = 0               # tokens handed to the event loop (follower thread only)
    followed: bool = False      # its end was handed over too: not followed any more
    num_tokens: int = 0         # tokens in the answer so far
    outcome: str | None = None  # completed | failed | aborted, once it ended


class StopMatcher:
    """Finds stop strings in streamed text, holding back a tail that could begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.pending = stops, ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that is safe to send, whether a stop string ended the answer)."""
        if not self.stops:
            return text, False
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        cut = max(0, len(self.pending) - self.hold)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Frontend:
    def __init__(self, router, tokenizer, max_queue: int, retry_after_s: int, on_end=None):
        """`on_end(open, record)` is called once per admitted request when its answer ends."""
        self.router, self.tokenizer = router, tokenizer
        self.max_queue, self.retry_after_s, self.on_end = max_queue, retry_after_s, on_end
        self.draining = False
        self._open: dict[str, Open] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._follow, name="frontend-follow", daemon=True)
        self._thread.start()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests; wait up to `timeout_s` for those in flight, then fail the rest.
        Returns how many were failed."""
        self.draining = True
        deadline = time.monotonic() + timeout_s
        while self._open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = list(self._open)
        for rid in left:
            self.router.abort(rid, "failed: the server is shutting down")
        deadline = time.monotonic() + 5.0          # let their answers say so
        while self._open and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return len(left)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def counts(self) -> dict:
        """In flight: waiting for a first token, and producing tokens."""
        with self._lock:
            ops = list(self._open.values())
        waiting = sum(op.seen == 0 for op in ops)
        return {"waiting": waiting, "running": len(ops) - waiting}

    # -- admission ------------------------------------------------------------------------------
    def admit(self, gen: Generation, arrival_s: float | None = None) -> Open:
        """Submit it, its record's clock started at `arrival_s` (when its HTTP request came in)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="service_unavailable",
                           retry_after_s=self.retry_after_s)
        if len(self._open) >= self.max_queue:
            raise APIError(429, f"admission queue full: {len(self._open)} requests in flight "
                                f"(serve.max_queue={self.max_queue}); retry later", code="rate_limit_exceeded",
                           retry_after_s=self.retry_after_s)
        rid = f"{'cmpl' if gen.kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        rec = self.router.submit(rid, gen.prompt_ids, gen.params, arrival_s=arrival_s)
        if rec.done:        # refused at admission: the rules of workers/request.py, or it can never fit
            self.router.forget(rid)
            reason = rec.reason or "refused"
            if reason.startswith("rejected: "):
                reason = reason.removeprefix("rejected: ")
                raise APIError(400, reason, param=param_of(reason))
            raise APIError(503, reason, code="service_unavailable", retry_after_s=self.retry_after_s)
        op = Open(rid, gen, rec, asyncio.Queue())
        with self._lock:
            self._open[rid] = op
        return op

    # -- answers --------------------------------------------------------------------------------
    async def pieces(self, op: Open):
        """The answer, one Piece per token, then a last Piece with the finish reason. Raises APIError
        if the request fails; a reader that stops early aborts it (the workers free its KV)."""
        detok = self.tokenizer.detokenizer(op.gen.prompt_ids) if self.tokenizer is not None else None
        stops = StopMatcher(op.gen.stop)
        try:
            while True:
                up: StreamUpdate = await op.queue.get()
                rec = op.record
                for i, token in enumerate(up.token_ids):
                    op.num_tokens += 1
                    last = up.done and i == len(up.token_ids) - 1
                    stop_token = last and rec.status == "ok" and rec.finish_reason == "stop"
                    text = ""
                    if detok is not None:       # the token that stopped it is not text
                        text = ("" if stop_token else detok.add(token)) + (detok.flush() if last else "")
                    text, hit = stops.feed(text)
                    if hit:
                        self._end(op, "completed", abort="finished: a stop string matched", finish="stop")
                        yield Piece(text, [token], "stop")
                        return
                    yield Piece(text, [token])
                if up.done:
                    if rec.status != "ok":
                        self._end(op, "failed")
                        status = 503 if "shutting down" in (rec.reason or "") else 500
                        raise APIError(status, f"request failed: {rec.reason}", admitted=True)
                    self._end(op, "completed")
                    yield Piece(stops.flush(), [], rec.finish_reason)
                    return
        finally:
            if op.outcome is None:      # the reader went away (disconnect, cancel)
                self._end(op, "aborted", abort="aborted: the client went away")

    def _end(self, op: Open, outcome: str, abort: str | None = None, finish: str | None = None) -> None:
        if abort is not None:
            self.router.abort(op.rid, abort, finish_reason=finish)
        op.outcome = outcome
        with self._lock:
            self._open.pop(op.rid, None)
        rec = self.router.forget(op.rid) or op.record
        if self.on_end is not None:
            try:
                self.on_end(op, rec)
            except Exception:
                log.exception("recording request %s failed", op.rid)

    # -- the follower thread --------------------------------------------------------------------
    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                with self._lock:
                    seen = {rid: op.seen for rid, op in self._open.items() if not op.followed}
                updates = self.router.follow(seen, FOLLOW_WAIT_S)
                for rid, up in updates.items():
                    with self._lock:
                        op = self._open.get(rid)
                    if op is None:
                        continue
                    op.seen += len(up.token_ids)
                    op.followed = up.done
                    self._loop.call_soon_threadsafe(op.queue.put_nowait, up)
            except RuntimeError:            # the event loop closed under us: shutting down
                if self._loop.is_closed():
                    return
                log.exception("frontend follower")
            except Exception:               # a bug here must not stop every stream
                log.exception("frontend follower")
                time.sleep(FOLLOW_WAIT_S)
