"""JSON-line messages between the launcher and its two workers, over the workers' stdin/stdout.

A worker keeps its real stdout for messages and points file descriptor 1 at stderr, so whatever
a library prints cannot corrupt the stream. The launcher reads each worker on a thread and
waits for a message with a deadline, so a stuck or dead worker fails the run instead of
hanging it.
"""

import json
import os
import queue
import subprocess
import sys
import threading
import time


class WorkerChannel:
    """A worker's end: reads the launcher's messages from stdin, writes its own to stdout."""

    def __init__(self):
        """Takes over stdout for messages; anything else written to fd 1 goes to stderr."""
        self._out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr

    def send(self, message: dict) -> None:
        """Writes `message` as one JSON line."""
        self._out.write(json.dumps(message) + "\n")

    def receive(self) -> dict | None:
        """The launcher's next message, or None once it closed the pipe."""
        line = sys.stdin.readline()
        return json.loads(line) if line else None


class Worker:
    """The launcher's handle on one worker process and its messages."""

    def __init__(self, name: str, argv: list[str]):
        """Starts `argv` with piped stdin/stdout (stderr shared with the launcher)."""
        self.name = name
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self._messages: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self._messages.put(json.loads(line))
        self._messages.put(None)

    def send(self, message: dict) -> None:
        """Writes `message` to the worker's stdin as one JSON line."""
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def receive(self, event: str, deadline: float) -> dict:
        """The worker's next message, which must be `event`, by `deadline` (time.monotonic)."""
        try:
            message = self._messages.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(
                f"the {self.name} worker sent no '{event}' in time; see its log above"
            ) from None
        if message is None:
            code = self.process.wait()
            raise RuntimeError(
                f"the {self.name} worker exited (code {code}) before sending '{event}'; "
                "see its log above"
            )
        if message.get("event") != event:
            raise RuntimeError(
                f"the {self.name} worker sent {message!r} where '{event}' was expected"
            )
        return message

    def finish(self, timeout: float) -> int:
        """Closes the worker's stdin and waits up to `timeout` s for it to exit (killed after)."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            return self.process.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise TimeoutError(
                f"the {self.name} worker did not exit in time and was killed"
            ) from None

    def kill(self) -> None:
        """Ends the worker at once (after a failure elsewhere) and reaps it."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
