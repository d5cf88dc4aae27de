"""Runs python-tool calls the way the rollout does (`build_tools`, then `executor.execute("python", code)`).

Imported by test_tools_abuse.py for the root trainer, and executed as a script for the unprivileged
trainer (`setpriv ... python3 sandbox_harness.py < request.json`), so both go through the same code.
Standard library only, so that any Python 3 of the machine can run it as another user: the request
is JSON on stdin, `{"tool": {tools.python keys}, "codes": [...], "concurrent": bool,
"executor_timeout_s": float}`; the answer is JSON on stdout, one `{text, error, truncated}` per code,
plus the tool's `isolation` description and the harness's pid (it names the runs' cgroups). Test-only
request keys: `no_seccomp` drops the tool's seccomp filter (to show that a run ends even when it could
tamper with its init), `trainer_key` puts a key with that payload in the trainer's own session keyring
first (`__TRAINER_KEY__` in a program is its id) and reports what the trainer reads from it afterwards.
"""

import asyncio
import ctypes
import json
import os
import platform
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# keyctl, add_key by architecture (the C library has no wrapper for them)
KEY_SYSCALLS = {"x86_64": (250, 248), "aarch64": (219, 217)}
KEYCTL_JOIN_SESSION_KEYRING, KEYCTL_READ, KEY_SPEC_SESSION_KEYRING = 1, 11, -3


def _syscall(number, *args):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    result = libc.syscall(number, *args)
    return result if result >= 0 else -ctypes.get_errno()


def add_trainer_key(payload: str) -> int:
    """A fresh session keyring for this trainer holding one user key; returns the key's id."""
    keyctl, add_key = KEY_SYSCALLS[platform.machine()]
    _syscall(keyctl, KEYCTL_JOIN_SESSION_KEYRING, b"arpo-trainer")
    data = payload.encode()
    return _syscall(add_key, b"user", b"arpo-trainer-secret", data, len(data), KEY_SPEC_SESSION_KEYRING)


def read_key(key: int) -> str:
    keyctl = KEY_SYSCALLS[platform.machine()][0]
    buffer = ctypes.create_string_buffer(256)
    size = _syscall(keyctl, KEYCTL_READ, key, buffer, 256)
    return buffer.raw[:size].decode() if size >= 0 else f"error {-size}"


def run_calls(tool: dict, codes: list, concurrent: bool = False, executor_timeout_s: float = 60.0,
              no_seccomp: bool = False) -> dict:
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from megatron_arpo.tools.registry import build_tools

    executor = build_tools({"python": dict(tool), "search": None, "timeout_s": executor_timeout_s,
                            "max_concurrency": max(1, len(codes))})
    if no_seccomp:
        executor.tools["python"].command.seccomp = None

    async def main():
        try:
            if concurrent:
                return await asyncio.gather(*(executor.execute("python", code) for code in codes))
            return [await executor.execute("python", code) for code in codes]
        finally:
            await executor.close()

    results = asyncio.run(main())
    return {
        "isolation": executor.tools["python"].isolation,
        "pid": os.getpid(),
        "results": [{"text": r.text, "error": r.error, "truncated": r.truncated} for r in results],
    }


if __name__ == "__main__":
    request = json.load(sys.stdin)
    # Programs may name the trainer's own pid, as an attacker that guessed it would.
    codes = [code.replace("__TRAINER_PID__", str(os.getpid())) for code in request["codes"]]
    key = add_trainer_key(request["trainer_key"]) if request.get("trainer_key") else None
    if key is not None:
        codes = [code.replace("__TRAINER_KEY__", str(key)) for code in codes]
    try:
        answer = run_calls(request["tool"], codes, request.get("concurrent", False),
                           request.get("executor_timeout_s", 60.0), request.get("no_seccomp", False))
    except Exception as exc:  # reported to the test, which shows it
        answer = {"exception": f"{type(exc).__name__}: {exc}"}
    if key is not None:
        answer["trainer_key_after"] = read_key(key)
    json.dump(answer, sys.stdout)
