"""A per-item timeline of a chain's work, written as Chrome / Perfetto trace JSON.

Every span is one stage working on one item (a prefill chunk, a decode step) or one transfer
between stages: the host time it was issued at, and its start and end on the device. Device
times come from marks recorded on each backend's stream (CUDA events on a GPU, host clocks on
the cpu backend); each device's clock is tied to the host's once, at the first span, by waiting
for a mark and reading the host clock, so all tracks share one time axis (to within that wait,
tens of microseconds). Open the file in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import attrs

from kerncc.atomic import write_text_atomic


@attrs.define
class Span:
    backend: Any
    track: str
    name: str
    issued: float  # host perf_counter seconds
    start: Any
    end: Any
    args: dict


class Timeline:
    """Spans of a run; `rows()` resolves them (waiting for the device), `write` saves them."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._origins: dict[int, tuple[Any, float]] = {}  # id(backend) -> (mark, host seconds)
        self.t0 = time.perf_counter()

    def span(self, backend: Any, track: str, name: str, issued: float, start: Any, end: Any,
             args: dict) -> None:
        if id(backend) not in self._origins:
            mark = backend.mark()
            backend.sync()
            self._origins[id(backend)] = (mark, time.perf_counter())
        self.spans.append(Span(backend, track, name, issued, start, end, args))

    def _host_seconds(self, backend: Any, mark: Any) -> float:
        origin, host = self._origins[id(backend)]
        return host + backend.elapsed_ms(origin, mark) / 1e3

    def rows(self) -> list[dict]:
        """Every span as {track, name, issued, start, done} in ms from the timeline's start."""
        out = []
        for s in self.spans:
            start = self._host_seconds(s.backend, s.start)
            done = self._host_seconds(s.backend, s.end)
            out.append({"track": s.track, "name": s.name,
                        "issued_ms": (s.issued - self.t0) * 1e3,
                        "start_ms": (start - self.t0) * 1e3,
                        "done_ms": (done - self.t0) * 1e3, **s.args})
        return out

    def chrome(self) -> dict:
        """The trace as Chrome's JSON object format (one process per device, one thread per
        track; every span an `X` event, its host issue an instant on the `host` track)."""
        events: list[dict] = []
        tids: dict[tuple[str, str], int] = {}
        for row, s in zip(self.rows(), self.spans):
            pid = getattr(s.backend, "describe", lambda: s.backend.name)()
            tid = tids.setdefault((pid, row["track"]), len(tids) + 1)
            args = {k: v for k, v in row.items() if k not in ("track", "name")}
            events.append({"name": row["name"], "ph": "X", "pid": pid, "tid": tid,
                           "ts": round(row["start_ms"] * 1e3, 3),
                           "dur": round(max(row["done_ms"] - row["start_ms"], 0) * 1e3, 3),
                           "args": args})
            events.append({"name": f"issue {row['name']}", "ph": "i", "s": "t", "pid": "host",
                           "tid": 0, "ts": round(row["issued_ms"] * 1e3, 3)})
        for (pid, track), tid in tids.items():
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": track}})
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike) -> None:
        write_text_atomic(path, json.dumps(self.chrome(), indent=1) + "\n")
