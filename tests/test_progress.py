"""Progress lines: drawn on a terminal (throttled, nested bars on one line, results printed above them),
and nothing at all when stderr is a file; serve_all counts its repeats on one."""
import io

import pytest
from omegaconf import OmegaConf

from experiments import progress
from experiments.progress import Progress, echo


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


@pytest.fixture(autouse=True)
def no_bar_left_open():
    yield
    assert progress._open == [], "every bar is closed"


def last_line(text: str) -> str:
    return text.rsplit("\r\x1b[K", 1)[-1]


def test_nothing_is_written_when_the_stream_is_not_a_terminal(capsys):
    log = io.StringIO()
    with Progress("served", total=3, unit="repeats", stream=log) as bar:
        for _ in bar.each(range(3)):
            echo("a result")
    assert log.getvalue() == "" and bar.done == 3
    assert capsys.readouterr().out == "a result\n" * 3


def test_the_line_counts_its_share_time_and_time_left_and_is_throttled():
    tty, clock = Terminal(), Clock()
    bar = Progress("served", total=4, unit="repeats", stream=tty, interval=0.5, clock=clock)
    assert last_line(tty.getvalue()) == "served 0/4 repeats, 0%, 0 s"
    clock.t = 10.0
    bar.update(failed=0)
    assert last_line(tty.getvalue()) == "served 1/4 repeats, 25%, 10 s, about 30 s left, failed=0"
    clock.t = 10.2                                   # within the interval: counted, not drawn
    bar.update(failed=1)
    assert bar.done == 2 and "served 1/4" in last_line(tty.getvalue())
    clock.t = 130.0
    bar.update()
    assert last_line(tty.getvalue()) == "served 3/4 repeats, 75%, 2 min 10 s, about 43 s left, failed=1"
    bar.close()
    assert tty.getvalue().endswith("\r\x1b[K"), "the line is cleared at the end"


def test_without_a_total_it_counts_what_is_done():
    tty = Terminal()
    with Progress("simulated", unit="cells", stream=tty, interval=0) as bar:
        bar.update(sims=40)
        assert last_line(tty.getvalue()) == "simulated 1 cells, 0 s, sims=40"


def test_nested_bars_share_one_line_and_results_print_above_it(capsys):
    tty = Terminal()
    outer = Progress("served", total=2, unit="repeats", stream=tty, interval=0)
    inner = Progress("a rep0", total=8, unit="requests", stream=tty, interval=0)
    inner.update(3)
    assert last_line(tty.getvalue()) == "served 0/2 repeats, 0%, 0 s | a rep0 3/8 requests, 38%, 0 s, about 0 s left"
    inner.close()
    assert last_line(tty.getvalue()) == "served 0/2 repeats, 0%, 0 s", "the outer bar is drawn again alone"
    before = len(tty.getvalue())
    echo("a rep 1/2: 8/8 ok")
    drawn = tty.getvalue()[before:]
    assert drawn.startswith("\r\x1b[K") and last_line(drawn) == "served 0/2 repeats, 0%, 0 s"
    assert capsys.readouterr().out == "a rep 1/2: 8/8 ok\n"
    outer.close()


def test_serve_all_counts_every_repeat_on_a_terminal_and_writes_only_results_to_a_log(tmp_path, monkeypatch, capsys):
    from experiments.serving.serve import Prepared, serve_all

    def points():
        return [Prepared(tmp_path / name, OmegaConf.create({"name": name}), None, [], {"label": name}, None)
                for name in ("a", "b")]

    def serve(p, repeat, out):
        (out / "metrics.json").write_text("{}")
        return {"num_completed": 1, "num_submitted": 1}

    tty = Terminal()
    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)
    monkeypatch.setattr("sys.stderr", tty)
    serve_all(points(), 2, serve)
    counts = [x.split(",")[0] for x in tty.getvalue().split("\r\x1b[K") if x]     # redrawn under each result too
    assert list(dict.fromkeys(counts)) == [f"served {k}/4 repeats" for k in range(5)]
    out = capsys.readouterr().out
    assert "\r" not in out and out.count("1/1 ok") == 4

    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    serve_all(points(), 3, serve)               # the first two repeats are on disk: skipped, and said so
    assert log.getvalue() == ""
    assert capsys.readouterr().out.count("skipped") == 4
