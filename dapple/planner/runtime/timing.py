"""How a step's compute is timed on a GPU: CUDA events.

On the CPU the executor times each forward and backward with the host's
clock (``time.perf_counter``), less the time blocked in its receives. On
CUDA that clock measures kernel launches: kernels run asynchronously, and
the host waits for them only at the step's final synchronisation. So there
:class:`EventTimer` records a pair of events on the current stream around
each forward and backward, and a pair around each receive inside it (the
time the stream stood waiting for the data), and reads them all once, at
the end of the step, after one synchronisation: the step's compute is the
passes' GPU time less the receives' waits, the host clock's rule on the
GPU's clock.
"""

from __future__ import annotations

from typing import Any, Callable


class EventTimer:
    """Spans between pairs of timing events on one stream, read once.

    ``event``: the event class, ``torch.cuda.Event`` on a GPU (any class
    with ``record()``, ``synchronize()`` and ``elapsed_time(end)`` in
    milliseconds, so tests can hand it a fake)."""

    def __init__(self, event: Callable[..., Any] | None = None):
        if event is None:
            import torch

            event = torch.cuda.Event
        self.event = event
        #: (start, end, sign): +1 a pass, -1 a receive's wait inside one.
        self.spans: list[tuple[Any, Any, int]] = []

    def start(self) -> Any:
        """An event recorded now on the stream: where a span begins."""
        e = self.event(enable_timing=True)
        e.record()
        return e

    def stop(self, start: Any, sign: int = 1) -> None:
        """End the span begun at ``start`` (``sign`` -1: time to subtract)."""
        self.spans.append((start, self.start(), sign))

    def seconds(self) -> float:
        """The sum of the spans since the last call, in seconds, after one
        wait for the last event (the stream runs them in order)."""
        if not self.spans:
            return 0.0
        self.spans[-1][1].synchronize()
        total_ms = sum(sign * start.elapsed_time(end) for start, end, sign in self.spans)
        self.spans.clear()
        return total_ms / 1e3
