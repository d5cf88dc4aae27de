"""Runs python-tool calls the way the rollout does (`build_tools`, then `executor.execute("python", code)`).

Imported by test_tools_abuse.py for the root trainer, and executed as a script for the unprivileged
trainer (`setpriv ... python3 sandbox_harness.py < request.json`), so both go through the same code.
Standard library only, so that any Python 3 of the machine can run it as another user: the request
is JSON on stdin, `{"tool": {tools.python keys}, "codes": [...], "concurrent": bool,
"executor_timeout_s": float}`; the answer is JSON on stdout, one `{text, error, truncated}` per code,
plus the tool's `isolation` description.
"""

import asyncio
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_calls(tool: dict, codes: list, concurrent: bool = False, executor_timeout_s: float = 60.0) -> dict:
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    from megatron_arpo.tools.registry import build_tools

    executor = build_tools({"python": dict(tool), "search": None, "timeout_s": executor_timeout_s,
                            "max_concurrency": max(1, len(codes))})

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
        "results": [{"text": r.text, "error": r.error, "truncated": r.truncated} for r in results],
    }


if __name__ == "__main__":
    request = json.load(sys.stdin)
    # Programs may name the trainer's own pid, as an attacker that guessed it would.
    codes = [code.replace("__TRAINER_PID__", str(os.getpid())) for code in request["codes"]]
    try:
        answer = run_calls(request["tool"], codes, request.get("concurrent", False),
                           request.get("executor_timeout_s", 60.0))
    except Exception as exc:  # reported to the test, which shows it
        answer = {"exception": f"{type(exc).__name__}: {exc}"}
    json.dump(answer, sys.stdout)
