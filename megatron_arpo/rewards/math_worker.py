"""math-verify in a child process, for callers that cannot use its signal timeouts (any thread but main).

sympy can spend minutes in C code holding the GIL (``\\boxed{9^{9^{9^9}}}`` builds a power tower), so a
thread cannot be abandoned in time and a signal cannot interrupt it. A :class:`VerifyWorker` is a child
Python (``python -m megatron_arpo.rewards.math_worker``) that answers one JSON line per request on its
main thread, where math-verify's own alarm works; the parent waits ``timeout + GRACE_S`` and, past that,
kills the child (the next call starts a fresh one). Idle workers are kept for reuse, one per concurrent
caller at most.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

from megatron_arpo.rewards.text import find_closing_brace

logger = logging.getLogger(__name__)

GRACE_S = 2.0  # beyond math-verify's own timeout, before the child is killed
START_TIMEOUT_S = 300.0  # importing sympy on a loaded machine; not counted in a call's timeout
_REPO = str(Path(__file__).resolve().parents[2])


class VerifyWorker:
    """One child process running math-verify; ``verify`` raises TimeoutError (and kills it) when it overruns."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_arpo.rewards.math_worker"], cwd=_REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self._pending = b""
        if self._read_line(START_TIMEOUT_S) != {"ready": True}:
            self.kill()
            raise RuntimeError("math-verify worker did not start")

    def _read_line(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None  # the child died
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def verify(self, prediction: str, gold: str, timeout_seconds: int) -> bool:
        self.proc.stdin.write(json.dumps({"prediction": prediction, "gold": gold, "timeout": timeout_seconds}).encode()
                              + b"\n")
        self.proc.stdin.flush()
        answer = self._read_line(timeout_seconds + GRACE_S)
        if answer is None:
            self.kill()
            raise TimeoutError(f"math-verify did not finish within {timeout_seconds} s (worker killed)")
        if "error" in answer:
            raise ValueError(answer["error"])
        return bool(answer["equal"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


_idle: list[VerifyWorker] = []
_lock = threading.Lock()


def verify_in_worker(prediction: str, gold: str, timeout_seconds: int) -> bool:
    """math-verify's ``prediction == gold`` in an idle worker (started when none is); TimeoutError past the limit."""
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is None:
        worker = VerifyWorker()
    try:
        result = worker.verify(prediction, gold, timeout_seconds)
    except TimeoutError:
        raise  # that worker was killed
    except ValueError:
        _release(worker)  # math-verify failed on this input; the worker is fine
        raise
    except BaseException:
        worker.kill()  # interrupted mid-request: its late answer must not reach the next caller
        raise
    _release(worker)
    return result


def _release(worker: VerifyWorker) -> None:
    with _lock:
        _idle.append(worker)


def _as_boxed(answer: str) -> str:
    stripped = answer.strip()
    # Only wrap when the braces balance; otherwise math-verify would mis-read the boxed span.
    balanced = find_closing_brace("{" + stripped + "}", 0) == len(stripped) + 1
    return f"\\boxed{{{stripped}}}" if balanced else stripped


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its timeout is off; here that is deliberate (no signals off the main thread)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


_warning_filter_installed = False


def verify_here(prediction: str, gold: str, timeout_seconds: int) -> bool:
    """math-verify in this process, its timeout enforced with signals: main thread, no other timer."""
    return _verify(prediction, gold, timeout_seconds)


def _verify(prediction: str, gold: str, native_timeout: int | None) -> bool:
    global _warning_filter_installed
    # deferred: pulls in math_verify (heavy; this module imports without it)
    from math_verify import parse, verify  # heavy (sympy); imported on first use

    if not _warning_filter_installed:
        for name in ("math_verify.parser", "math_verify.grader"):
            logging.getLogger(name).addFilter(_DropTimeoutDisabledWarning())
        _warning_filter_installed = True

    gold_parsed = parse(_as_boxed(gold), parsing_timeout=native_timeout)
    pred_parsed = parse(_as_boxed(prediction), parsing_timeout=native_timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=native_timeout))


@atexit.register
def _stop_workers() -> None:
    with _lock:
        workers, _idle[:] = list(_idle), []
    for worker in workers:
        worker.kill()


def _serve() -> None:
    # Here, in the child only: sympy and math-verify load before "ready", outside any call's timeout.
    import math_verify  # noqa: F401

    out = sys.stdout.buffer
    out.write(b'{"ready": true}\n')
    out.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        try:
            answer = {"equal": verify_here(request["prediction"], request["gold"], int(request["timeout"]))}
        except Exception as exc:  # noqa: BLE001 - any parser failure is "not shown equal" in the parent
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(answer).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    _serve()
