"""Progress of long work (SFT and RL steps, evaluation, conversion): one reporter for all of them.

On a terminal the reporter draws a tqdm bar. When stderr is a file or a pipe (Slurm ``.out`` files, the
demo's stage logs) it writes plain log lines instead, never carriage-return fragments: the first unit of
work, then at most one line per ``interval_s`` (30 s by default), then the last. A line reads::

    sft: 12/80 steps (15%) | 2.1 s/step | 1830 tok/s | elapsed 25 s | ETA 2.4 min

The time per unit and the rate are measured over the units since the previous line, so a slow first step
(compilation, warm-up) stops counting once the next line is written; the ETA is the remaining units times
that time per unit. Lines go to the ``megatron_arpo.progress`` logger, whose records the demo forwards to
its console (``megatron_arpo/demo.py``). ``strip_ansi`` removes terminal escape codes from text bound
for a log file.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from typing import IO, Any, Callable

from tqdm import tqdm

LOGGER_NAME = "megatron_arpo.progress"
logger = logging.getLogger(LOGGER_NAME)

DEFAULT_INTERVAL_S = 30.0

# CSI sequences (colours, cursor moves: ESC [ ... final byte), OSC sequences (ESC ] ... BEL or ESC \), the
# character-set selections (ESC ( B: intermediate bytes, then a final byte) and the two-byte escapes.
_ANSI = r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[ -/]+[0-~]|\x1b[@-Z\\-_]"
ANSI_RE = re.compile(_ANSI)
ANSI_BYTES_RE = re.compile(_ANSI.encode())


def strip_ansi(text: str) -> str:
    return ANSI_RE.sub("", text)


def strip_ansi_bytes(data: bytes) -> bytes:
    return ANSI_BYTES_RE.sub(b"", data)


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def format_duration(seconds: float) -> str:
    if seconds != seconds or seconds == float("inf"):
        return "?"
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _format_rate(value: float) -> str:
    if value >= 1e6:
        return f"{value / 1e6:.2f}M"
    if value >= 1e4:
        return f"{value / 1e3:.1f}k"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


class Progress:
    """Counts units of work (``update``); a bar on a terminal, periodic log lines otherwise.

    ``done`` is where a resumed run starts (the ETA counts only work timed in this process); ``rate_unit``
    names the ``amount`` passed to ``update`` (``"tok"`` for tokens, ``"MB"``) and shows its rate per second.
    ``bar`` forces the mode (default: a bar iff ``stream`` is a terminal).
    """

    def __init__(self, what: str, total: int | None, *, unit: str = "step", done: int = 0,
                 rate_unit: str | None = None, interval_s: float = DEFAULT_INTERVAL_S, stream: IO | None = None,
                 bar: bool | None = None, clock: Callable[[], float] = time.monotonic):
        self.what, self.total, self.unit, self.rate_unit = what, total, unit, rate_unit
        self.interval_s = interval_s
        self.clock = clock
        self.done = done
        self.start = self._mark = clock()
        self._mark_done, self._mark_amount, self.amount = done, 0.0, 0.0
        self._last_line: float | None = None
        self._step_s = float("nan")
        self._rate = float("nan")
        stream = sys.stderr if stream is None else stream
        self._bar = None
        if is_terminal(stream) if bar is None else bar:
            self._bar = tqdm(total=total, initial=done, desc=what, unit=unit, file=stream, dynamic_ncols=True,
                             mininterval=1.0, leave=True)

    # ---- the numbers -------------------------------------------------------------------------------
    @property
    def remaining(self) -> int | None:
        return None if self.total is None else max(self.total - self.done, 0)

    def eta_s(self) -> float | None:
        """Remaining units times the time per unit of the last window (None without a total)."""
        if self.remaining is None:
            return None
        return self.remaining * self._step_s if self.remaining else 0.0

    def status(self) -> str:
        head = f"{self.what}: {self.done}"
        if self.total is not None:
            pct = 100.0 * self.done / self.total if self.total else 100.0
            head += f"/{self.total} {self.unit}s ({pct:.0f}%)"
        else:
            head += f" {self.unit}s"
        parts = [head]
        if self._step_s == self._step_s:
            parts.append(f"{self._step_s:.3g} s/{self.unit}" if self._step_s < 100 else
                         f"{format_duration(self._step_s)}/{self.unit}")
        if self.rate_unit and self._rate == self._rate:
            parts.append(f"{_format_rate(self._rate)} {self.rate_unit}/s")
        parts.append(f"elapsed {format_duration(self.clock() - self.start)}")
        eta = self.eta_s()
        if eta is not None and eta == eta:
            parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    # ---- reporting ----------------------------------------------------------------------------------
    def _measure(self, now: float) -> None:
        units = self.done - self._mark_done
        seconds = now - self._mark
        if units > 0 and seconds >= 0:
            self._step_s = seconds / units
            self._rate = (self.amount - self._mark_amount) / seconds if seconds > 0 else float("nan")
            self._mark, self._mark_done, self._mark_amount = now, self.done, self.amount

    def update(self, n: int = 1, amount: float = 0.0) -> None:
        """``n`` more units done, carrying ``amount`` of ``rate_unit`` (tokens, bytes) between them."""
        self.done += n
        self.amount += amount
        now = self.clock()
        if self._bar is not None:
            self._bar.update(n)
            if self.rate_unit and now > self.start:
                self._bar.set_postfix_str(f"{_format_rate(self.amount / (now - self.start))} {self.rate_unit}/s",
                                          refresh=False)
            return
        first = self._last_line is None
        last = self.remaining == 0
        if first or last or now - self._last_line >= self.interval_s:
            self._measure(now)
            self._emit(now)

    def _emit(self, now: float) -> None:
        self._last_line = now
        logger.info(self.status())

    def close(self) -> None:
        """Closes the bar; writes the final line when units were done since the last one."""
        if self._bar is not None:  # one line for the whole run stays in the log after the bar is gone
            self._bar.close()
            self._bar = None
        if self.done > self._mark_done:
            now = self.clock()
            self._measure(now)
            self._emit(now)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
