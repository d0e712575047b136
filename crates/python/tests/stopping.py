"""Stopping a peer process for a test: ``SIGSTOP`` is delivered when the kernel next schedules
the process, not when ``kill`` returns, so a test that needs the peer to have stopped waits
until ``/proc`` says it has."""

import os
import signal
import time


def stop(pid: int, timeout_s: float = 5.0) -> None:
    """Sends ``SIGSTOP`` to ``pid`` and returns once the process is stopped (state ``T``)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            # The state follows the command name, which is in parentheses and may hold spaces.
            state = stat.read().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop within {timeout_s} s of SIGSTOP")
