"""Progress of long work (points served, repeats, simulations) as one line on a terminal, and nothing in a log.

    with Progress("served", total=len(points), unit="repeat") as bar:
        for p in points:
            ...
            bar.update(ok=n)          # notes are shown after the count: "ok=12"
            echo("a result line")     # printed above the bar, which is drawn again under it

The line goes to stderr and only when stderr is a terminal: a run whose output goes to a file or to CI
writes only its results. It is redrawn at most every `interval` seconds (INTERVAL_S). Bars opened inside one another
(the repeats of a run, the requests of one repeat) share the line, outermost first.
"""
from __future__ import annotations

import sys
import time

_open: list["Progress"] = []      # the bars being drawn, outermost first
INTERVAL_S = 0.5                  # the least time between two draws of a bar
_CLEAR = "\r\x1b[K"


class Progress:
    def __init__(self, what: str, total: int | None = None, unit: str = "", stream=None, interval: float | None = None,
                 clock=time.monotonic):
        self.what, self.total, self.unit, self.clock = what, total, unit, clock
        self.interval = INTERVAL_S if interval is None else interval
        self.stream = sys.stderr if stream is None else stream
        self.active = _isatty(self.stream)
        self.done, self.notes = 0, {}
        self.started = self.clock()
        self._drawn_at: float | None = None
        if self.active:
            _open.append(self)
            self._draw()

    def update(self, n: int = 1, **notes) -> None:
        """`n` more units done; `notes` replace the values shown after the count."""
        self.done += n
        self.notes.update(notes)
        if self.active and (self._drawn_at is None or self.clock() - self._drawn_at >= self.interval):
            self._draw()

    def each(self, items):
        """The items of `items`, one more unit done as each is finished with (when the next is asked for)."""
        for item in items:
            yield item
            self.update()

    def close(self) -> None:
        if not self.active:
            return
        self.active = False
        if self in _open:
            _open.remove(self)
        if _open:
            _open[-1]._draw()
        else:
            self.stream.write(_CLEAR)
            self.stream.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def line(self) -> str:
        """"what 3/12 unit, 25%, 4 s, about 12 s left, key=value": the count, its share and the time."""
        elapsed = self.clock() - self.started
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            parts = [f"{self.what} {self.done}/{self.total}{unit}", f"{self.done / self.total:.0%}", _dur(elapsed)]
            if 0 < self.done < self.total:
                parts.append(f"about {_dur(elapsed * (self.total - self.done) / self.done)} left")
        else:
            parts = [f"{self.what} {self.done}{unit}", _dur(elapsed)]
        parts += [f"{k}={v}" for k, v in self.notes.items()]
        return ", ".join(parts)

    def _draw(self) -> None:
        self._drawn_at = self.clock()
        self.stream.write(_CLEAR + " | ".join(p.line() for p in _open if p.stream is self.stream))
        self.stream.flush()


def echo(*args, **kwargs) -> None:
    """print(), above the progress line when one is drawn (the line is drawn again under it)."""
    bars = [p for p in _open if p.active]
    for stream in {id(p.stream): p.stream for p in bars}.values():
        stream.write(_CLEAR)
        stream.flush()
    print(*args, **kwargs, flush=True)
    if bars:
        bars[-1]._draw()
    for p in bars:                  # a result usually comes with a count: show the next at once
        p._drawn_at = None


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):          # no isatty, or closed
        return False


def _dur(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:02.0f} min"
