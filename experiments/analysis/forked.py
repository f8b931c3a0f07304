"""Independent tasks in forked processes: `run_all(tasks, jobs)` gives each task's result, in order.

Each child is a fork of this process, so a task (any callable, closures included) and everything it
reads are inherited rather than pickled; only results travel back. Serial where jobs is 1, there is a
single task, or the platform cannot fork.
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

_TASKS: list = []          # what the forked processes run, by index (set just before the fork)


def _run(i: int):
    return _TASKS[i]()


def run_all(tasks: list, jobs: int) -> list:
    if jobs <= 1 or len(tasks) <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [t() for t in tasks]
    _TASKS[:] = tasks
    try:
        with ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=multiprocessing.get_context("fork")) as pool:
            return list(pool.map(_run, range(len(tasks))))
    finally:
        _TASKS.clear()
