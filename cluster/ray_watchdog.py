"""Clean exits for an embedded Ray: when the driver dies, however it dies, no Ray process of its
cluster survives it.

Ray ties its GCS and raylet to the driver (PR_SET_PDEATHSIG), but not what the raylet starts: after a
`kill -9` of the driver its dashboard and runtime-env agents were seen alive minutes later, and
workers take seconds to notice. So the driver starts this small process once, holding the read end
of a pipe whose write end only the driver holds, and writes to it the session directory of each
embedded Ray it starts. Every Ray process keeps files open in its session directory (logs, sockets):
once the pipe reads EOF and the driver has exited (the pipe closes during the driver's interpreter
shutdown, while Ray's own exit handler may still be stopping its processes), the watchdog SIGKILLs
every process with a file open under one of those directories, and exits. (An environment mark does not do: Ray's agents rewrite
their process titles over their environment.)

    python cluster/ray_watchdog.py        (stdin: the pipe, one session directory a line)

Only the standard library: it must start fast and outlive everything it watches.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_pipe = None        # the write end, held for the driver's lifetime


def holding(directories: list[str]) -> list[int]:
    """Pids of the processes (readable to us) with a file open under one of `directories`."""
    prefixes = tuple(os.path.realpath(d) + os.sep for d in directories)
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in (os.getpid(), os.getppid()):
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{name}/fd/{fd}").startswith(prefixes):
                    found.append(int(name))
                    break
            except OSError:
                continue
    return found


def watch(session_dir: str) -> None:
    """Have the watchdog (started on first use) kill this session's processes once the driver dies."""
    global _pipe
    if not sys.platform.startswith("linux"):
        return
    if _pipe is None:
        read_end, write_end = os.pipe()
        subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=read_end, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        os.close(read_end)
        _pipe = os.fdopen(write_end, "w")
    _pipe.write(session_dir + "\n")
    _pipe.flush()


def main() -> None:
    driver = os.getppid()
    directories = [line.strip() for line in sys.stdin if line.strip()]   # ends at EOF: the driver is exiting
    while os.getppid() == driver:     # reparented the moment the driver has exited
        time.sleep(0.05)
    if not directories:
        return
    quiet = 0
    while quiet < 3:             # until nothing holds them (a dying raylet may still be starting a worker)
        pids = holding(directories)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        quiet = 0 if pids else quiet + 1
        time.sleep(0.2)


if __name__ == "__main__":
    main()
