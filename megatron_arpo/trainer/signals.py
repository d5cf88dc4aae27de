"""Stop requests (preemption notices) for the training loop, and how much notice a checkpoint needs.

The launcher contract (launchers/slurm.py, launchers/local.py): Slurm sends SIGUSR1
``launcher.signal_lead_seconds`` before the time limit; the trainer saves a checkpoint at its next safe
point and exits with ``launcher.preempt_exit_code`` (42 by default), which makes the batch script requeue
the job. SIGTERM (``scancel``, the local launcher's Ctrl-C) gets the same checkpoint, then exit code 143
(128 + SIGTERM, the conventional "terminated" code), which does not requeue.

Safe points inside a step (a 32B step can take longer than any lead Slurm is asked for): until the update
starts, the policy and optimizer are exactly the previous step's, so a stop during the rollout cancels it
(``StepAborted``), a stop during reward/log-prob phases abandons the step before the update, the sampler
is rewound to the step's first prompt and the checkpoint is the previous step's state. Once the update
runs it is finished (the weights are mid-change otherwise), the weight sync and validation are skipped,
and the checkpoint is saved. So a stop needs at most the longest phase that cannot be interrupted — the
log-prob pass or the update — plus a save. ``LeadTimeAdvisor`` measures both every step and warns when
``launcher.signal_lead_seconds`` is shorter than what they took.

The handlers only record the signal. Once a stop is decided, further SIGUSR1 are ignored (Slurm may
signal every process of the step again; USR1's default action would kill the exit path), while a
second SIGTERM takes the default action and ends the process at once, for an operator who does not
want to wait for the checkpoint.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
from typing import Any

logger = logging.getLogger(__name__)

EXIT_TERMINATED = 128 + int(signal.SIGTERM)
HANDLED = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    """Records the first SIGUSR1/SIGTERM; ``requested`` is checked by the loop at safe points."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @classmethod
    def install(cls) -> "StopRequest":
        stop = cls()
        stop.reinstall()
        return stop

    def reinstall(self) -> None:
        """(Re)install the handlers, e.g. after a library replaced them. Main thread only."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("signal handlers can only be installed from the main thread; run the trainer there")
        for signum in HANDLED:
            if self.signum is not None and signum == signal.SIGUSR1:
                continue  # already stopping: USR1 stays ignored
            previous = signal.signal(signum, self._handle)
            self._previous.setdefault(signum, previous)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            logger.warning("received %s: saving a checkpoint at the next safe point, then exiting",
                           signal.Signals(signum).name)
        if signum == signal.SIGUSR1:
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        else:
            signal.signal(signum, signal.SIG_DFL)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def exit_code(self, preempt_exit_code: int) -> int:
        """The process exit code after the stop checkpoint: the preemption code for USR1, 143 for TERM."""
        if self.signum == signal.SIGUSR1:
            return int(preempt_exit_code)
        if self.signum == signal.SIGTERM:
            return EXIT_TERMINATED
        return 0

    def __enter__(self) -> "StopRequest":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back the handlers found at install time (except an ignored USR1 after a stop)."""
        for signum, previous in self._previous.items():
            if signum == signal.SIGUSR1 and self.signum is not None:
                continue
            signal.signal(signum, previous)
        self._previous.clear()


class StepAborted(Exception):
    """A stop request cancelled a phase before the update: the step is abandoned, nothing changed."""


class LeadTimeAdvisor:
    """The notice a stop needs, from measured phase times: ``margin`` x (longest phase a stop must wait for
    + the last save) + ``exit_s`` for shutdown and requeue. Warns once when the configured lead is shorter."""

    def __init__(self, lead_s: int, margin: float = 1.25, exit_s: float = 60.0):
        self.lead_s, self.margin, self.exit_s = lead_s, margin, exit_s
        self.wait_s = self.save_s = 0.0
        self.warned = False

    def observe(self, seconds: dict[str, float]) -> dict[str, float]:
        """Fold in one step's phase times (``PhaseTimer.seconds``); returns the ``preempt/*`` metrics."""
        logprob = seconds.get("logprob", 0.0) + seconds.get("ref_logprob", 0.0)
        self.wait_s = max(self.wait_s, logprob, seconds.get("update", 0.0))
        if "save" in seconds:
            self.save_s = seconds["save"]
        needed = self.needed_s
        if self.lead_s and needed > self.lead_s and not self.warned and self.save_s:
            self.warned = True
            logger.warning("launcher.signal_lead_seconds=%d is shorter than a preemption checkpoint needs here: the "
                           "longest phase a stop waits for took %.0f s and the last save %.0f s (x%.2f + %.0f s to "
                           "exit) = %.0f s; set launcher.signal_lead_seconds >= %d", self.lead_s, self.wait_s,
                           self.save_s, self.margin, self.exit_s, needed, math.ceil(needed))
        return {"preempt/needed_lead_s": needed}

    @property
    def needed_s(self) -> float:
        return self.margin * (self.wait_s + self.save_s) + self.exit_s
