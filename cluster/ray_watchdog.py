"""Clean exits for an embedded Ray: when the driver dies, however it dies, no Ray process of its
cluster survives it.

Ray ties its GCS and raylet to the driver (PR_SET_PDEATHSIG), but not what the raylet starts: after a
`kill -9` of the driver its dashboard and runtime-env agents were seen alive minutes later, and
workers take seconds to notice. So the driver marks every process of its embedded cluster with an
environment variable (set only while `ray.init` spawns them; children inherit it), and starts this
small process holding the read end of a pipe whose write end only the driver holds. When the pipe
reads EOF (the driver is gone), it SIGKILLs every process that carries the mark, and exits.

    python cluster/ray_watchdog.py MARK        (stdin: the pipe)

Only the standard library: it must start fast and outlive everything it watches.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

OWNER_ENV = "PDLAB_RAY_OWNER"
_watching: dict[str, object] = {}        # mark -> the pipe's write end, held for the driver's lifetime


def marked(mark: str) -> list[int]:
    """Pids of the processes whose environment carries OWNER_ENV=mark (other users' are unreadable)."""
    needle = f"{OWNER_ENV}={mark}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def watch(mark: str) -> None:
    """Start the watchdog for `mark` (once per driver process)."""
    if mark in _watching or not sys.platform.startswith("linux"):
        return
    read_end, write_end = os.pipe()
    env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}
    subprocess.Popen([sys.executable, os.path.abspath(__file__), mark], stdin=read_end, env=env,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    os.close(read_end)
    _watching[mark] = os.fdopen(write_end, "wb")   # never written; closed only when the driver exits


def main(mark: str) -> None:
    while sys.stdin.buffer.read(1 << 16):        # returns b"" once every write end is closed
        pass
    # Sweep until nothing carries the mark (a dying raylet may still be starting a worker).
    quiet = 0
    while quiet < 3:
        pids = marked(mark)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        quiet = 0 if pids else quiet + 1
        time.sleep(0.2)


if __name__ == "__main__":
    main(sys.argv[1])
