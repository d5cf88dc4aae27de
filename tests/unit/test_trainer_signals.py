"""Stop requests (megatron_arpo.trainer.signals): real signals sent to this process."""

from __future__ import annotations

import os
import signal

import pytest

from megatron_arpo.trainer.signals import EXIT_TERMINATED, StopRequest


@pytest.fixture
def handlers():
    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def test_sigusr1_requests_a_stop_with_the_preemption_code_and_is_then_ignored(handlers):
    stop = StopRequest.install()
    assert not stop.requested and stop.exit_code(42) == 0
    os.kill(os.getpid(), signal.SIGUSR1)
    assert stop.requested and stop.signum == signal.SIGUSR1
    assert stop.exit_code(42) == 42 and stop.exit_code(17) == 17
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN  # a second notice cannot kill the exit path
    os.kill(os.getpid(), signal.SIGUSR1)
    stop.reinstall()  # after a stop, reinstalling keeps USR1 ignored
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    stop.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN


def test_sigterm_requests_a_stop_and_a_second_one_would_end_the_process(handlers):
    previous = signal.getsignal(signal.SIGTERM)
    stop = StopRequest.install()
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested and stop.exit_code(42) == EXIT_TERMINATED == 143
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    stop.restore()
    assert signal.getsignal(signal.SIGTERM) == previous


def test_first_signal_wins(handlers):
    stop = StopRequest.install()
    os.kill(os.getpid(), signal.SIGUSR1)
    signal.signal(signal.SIGTERM, stop._handle)  # still ours: a later TERM must not change the exit code
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signum == signal.SIGUSR1 and stop.exit_code(42) == 42
    stop.restore()


def test_a_stop_cancels_a_running_phase_at_once(handlers):
    """A USR1 during a (here: endless) rollout ends it within a poll interval as StepAborted, and the
    cancelled coroutine really stops (its cleanup runs)."""
    import asyncio
    import threading
    import time

    from megatron_arpo.trainer.state import Runtime
    from megatron_arpo.trainer.signals import StepAborted

    stop = StopRequest.install()
    cleaned = []

    async def endless_rollout():
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(True)

    rt = Runtime(cfg=None, run_dir=None)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    start = time.monotonic()
    with pytest.raises(StepAborted, match="the rollout of step 3 was cancelled by a stop request"):
        rt.run_async(endless_rollout(), 3600, "the rollout of step 3", "trainer.timeouts.rollout_s",
                     cancel_when=lambda: stop.requested)
    assert time.monotonic() - start < 10.0 and cleaned == [True]  # not the hour: a poll interval (plus a loaded host)
    # Without a stop the phase runs to its result.
    stop2 = StopRequest()
    assert rt.run_async(asyncio.sleep(0.05, result="done"), 10, "x", "k", cancel_when=lambda: stop2.requested) == "done"
    rt.loop.close()


def test_lead_time_advice_follows_the_measured_phases(caplog):
    from megatron_arpo.trainer.signals import LeadTimeAdvisor

    lead = LeadTimeAdvisor(900)
    # A 32B-like step: 40 min rollout (a stop cancels it), 8 min log-probs, 12 min update, no save yet.
    assert lead.observe({"rollout": 2400, "logprob": 480, "update": 720})["preempt/needed_lead_s"] == 1.25 * 720 + 60
    assert "signal_lead_seconds" not in caplog.text  # no save measured yet: no advice
    metrics = lead.observe({"rollout": 2300, "logprob": 500, "update": 700, "save": 300})
    assert metrics["preempt/needed_lead_s"] == 1.25 * (720 + 300) + 60  # the worst phase seen, the last save
    assert "launcher.signal_lead_seconds=900 is shorter" in caplog.text and ">= 1335" in caplog.text
    # A rollout never counts: it is cancelled, not waited for.
    assert LeadTimeAdvisor(900).observe({"rollout": 99999, "save": 10})["preempt/needed_lead_s"] == 1.25 * 10 + 60
