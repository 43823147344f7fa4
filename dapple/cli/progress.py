"""A sign of life on stderr while a long call runs (planning, compare): a
spinner with the time so far, shown only on a terminal, only once the call
has run ``DELAY_S`` seconds, and gone when it ends. The search reports no
progress of its own, so this says that it runs and for how long, not how
far it got."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator

import click
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

#: Seconds a call runs before anything is shown: shorter calls print nothing.
#: ``DAPPLE_PROGRESS_DELAY_S`` sets it (the tests set 0).
DELAY_S = 1.0


def quiet_option(f):
    return click.option("--quiet", is_flag=True, help="No progress indicator on stderr.")(f)


@contextlib.contextmanager
def working(what: str, quiet: bool) -> Iterator[None]:
    """Show ``what`` with a spinner and the elapsed time on stderr while the
    block runs, unless ``quiet`` or stderr is not a terminal."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    delay_s = float(os.environ.get("DAPPLE_PROGRESS_DELAY_S", DELAY_S))
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    progress.add_task(what, total=None)
    lock, done = threading.Lock(), threading.Event()

    def start() -> None:
        with lock:  # never after the block has ended and stopped it
            if not done.is_set():
                progress.start()

    timer = threading.Timer(delay_s, start)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        with lock:
            done.set()
            progress.stop()  # nothing to stop if it never started
