"""Another user's stream, timed while a test does something to the server: its inter-chunk gaps."""

from __future__ import annotations

import math
import threading
import time

import httpx

STREAM = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}


class StreamPacer:
    """Streams one completion after another in a thread (until `stop()`), recording every gap
    between two chunks of one stream with the time it ended. Encode big request bodies before
    starting it, and use the `quiet_collector` fixture: the test's own work holds this process's GIL."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.gaps: list[tuple[float, float]] = []  # (when the gap ended, its length)
        self._stop = threading.Event()
        self._enough = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> StreamPacer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        if self.error is not None:
            raise self.error

    def wait_for(self, count: int, timeout: float = 120) -> None:
        """Until `count` gaps have been recorded."""
        with self._enough:
            assert self._enough.wait_for(lambda: len(self.gaps) >= count or self.error is not None, timeout)
        if self.error is not None:
            raise self.error

    def worst(self, start: float = -math.inf, end: float = math.inf) -> float:
        """The longest gap that overlaps [start, end]."""
        return max((gap for at, gap in self.gaps if at >= start and at - gap <= end), default=0.0)

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=120) as client:
                while not self._stop.is_set():
                    self._one(client)
        except BaseException as exc:  # noqa: BLE001 - raised in the test's thread by stop()
            self.error = exc
            with self._enough:
                self._enough.notify_all()

    def _one(self, client: httpx.Client) -> None:
        last = None
        with client.stream("POST", self.url + "/v1/completions", json=STREAM) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                now = time.monotonic()
                if line.startswith("data: {"):
                    assert '"error"' not in line, line
                    if last is not None:
                        with self._enough:
                            self.gaps.append((now, now - last))
                            self._enough.notify_all()
                    last = now
                if self._stop.is_set():
                    return
