"""A sign of life while a step is captured, traced or planned.

A MIP solve can take from milliseconds to the whole time limit, and capturing a deep model takes
seconds per layer; a first training step that is silent for a minute looks hung. ``phase`` says
what is running once it has run ``after`` seconds: at INFO in the log (then every ``every``
seconds, and how long it took), and, when stderr is a terminal and the log does not show INFO
already, as one status line on stderr, rewritten each second, that ends with the outcome (a
plan's status and proven gap: quality never drops silently). Phases nest (a graph's capture
holds its solve): only the innermost one running rewrites the line. It lives in the driver, not
in ``solvers/``: the planners stay free of logging policy.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

logger = logging.getLogger(__name__)

FIRST_REPORT_SECONDS = 2.0
"""A phase shorter than this is not reported: most are."""

REPORT_EVERY_SECONDS = 10.0
"""How often the log says a phase is still running (the terminal line: every second)."""

_LINE_EVERY_SECONDS = 1.0
_running: list[int] = []  # the phases running now, innermost last (the one that owns the line)
_lock = threading.Lock()


@dataclass
class Outcome:
    """What the body of a phase may say about how it went, shown when the phase is reported."""

    text: str = ""


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # replaced or closed streams
        return False


@contextlib.contextmanager
def phase(doing: str, done: str, time_limit: float | None = None, *, after: float | None = None,
          every: float | None = None, stream: TextIO | None = None) -> Iterator[Outcome]:
    """Report ``doing`` ("solving a plan ...") while the body runs longer than ``after`` seconds,
    then ``done`` ("solved a plan ...") with the time it took and the body's ``Outcome``.

    >>> with phase("tracing a tiny step", "traced a tiny step"):  # fast: says nothing
    ...     pass
    """
    after = FIRST_REPORT_SECONDS if after is None else after
    every = REPORT_EVERY_SECONDS if every is None else every
    stream = sys.stderr if stream is None else stream
    live = _is_terminal(stream) and not logger.isEnabledFor(logging.INFO)
    started = time.perf_counter()
    finished = threading.Event()
    reported = threading.Event()
    limit = f" (time limit {time_limit:g}s)" if time_limit else ""
    outcome = Outcome()
    me = id(outcome)

    def report() -> None:
        wait, logged = after, -every
        while not finished.wait(wait):
            reported.set()
            elapsed = time.perf_counter() - started
            if elapsed - logged >= every:
                logger.info("still %s: %.0fs so far%s", doing, elapsed, limit)
                logged = elapsed
            with _lock:
                if live and _running and _running[-1] == me:
                    stream.write(f"\rremat_pass: {doing}: {elapsed:.0f}s{limit}\033[K")
                    stream.flush()
            wait = _LINE_EVERY_SECONDS if live else every

    with _lock:
        _running.append(me)
    thread = threading.Thread(target=report, name="remat-progress", daemon=True)
    thread.start()
    try:
        yield outcome
    finally:
        finished.set()
        thread.join()
        with _lock:
            _running.remove(me)
            if reported.is_set():
                elapsed = time.perf_counter() - started
                said = f": {outcome.text}" if outcome.text else ""
                logger.info("%s in %.1fs%s", done, elapsed, said)
                if live:
                    stream.write(f"\rremat_pass: {done} in {elapsed:.1f}s{said}\033[K\n")
                    stream.flush()


@contextlib.contextmanager
def solving(what: str, time_limit: float | None = None, *, after: float | None = None,
            every: float | None = None, stream: TextIO | None = None) -> Iterator[Outcome]:
    """``phase`` for a solve: "still solving <what>", then "solved <what> in ...".

    >>> with solving("a tiny plan"):  # fast: says nothing
    ...     pass
    """
    with phase(f"solving {what}", f"solved {what}", time_limit, after=after, every=every, stream=stream) as outcome:
        yield outcome


__all__ = ["FIRST_REPORT_SECONDS", "REPORT_EVERY_SECONDS", "Outcome", "phase", "solving"]
