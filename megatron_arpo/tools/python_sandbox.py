"""Python code-execution tool: one isolated, limited bubblewrap run per call (the reference ran model code
unconfined, docs/design/arpo_reference.md §6.1, Q9).

Every call starts a fresh sandbox (containment.py): its own user, PID, mount, IPC, network, UTS and
cgroup namespaces, a read-only view of the interpreter only, a size-capped private scratch /tmp, no
capabilities, no_new_privs, a seccomp filter (seccomp.py), never host root. When the program ends, or
is stopped, the tool kills the run's init (PID 1 of its namespace) through a pidfd on the pid bwrap
reports, and waits until it is gone: the kernel kills every process of the namespace first, even if
the run tampered with the init. What is left in the run's cgroup is killed before it is removed.
Limits hold for the run as a whole where the kernel allows (run_limits.py has the table): processes
through RLIMIT_NPROC in the run's own user namespace, memory through a cgroup when one can be had, disk
through the tmpfs size, CPU time and memory through a meter that samples the run's processes; rlimits
bound every single process as a backstop.

`sandbox: required` (the default) refuses to build the tool when bubblewrap cannot run, naming the
cause (missing package, or the sysctl that disables unprivileged user namespaces). `best_effort` runs
the code as a plain process with the same rlimits instead, and warns at every start.

Other behaviour:
- an environment built from scratch (no inherited API keys), one BLAS/OpenMP thread;
- code the interpreter cannot take (a NUL byte, a lone surrogate, over 100 KB) is a tool error without
  a run; code nested too deeply to parse is left to the sandboxed interpreter to report;
- a wall-clock timeout; stdout/stderr read incrementally with a byte cap; past the cap the run is
  stopped and marked truncated; the text shown to the model is cut to `max_output_chars`.
- Pre-processing (as the reference, V15): if the last top-level statement is an expression other than
  a bare `print(...)` call, it is wrapped in `print(...)`; code that does not parse is left unchanged.
  Unlike the reference, the wrap splices the source text instead of re-generating it from the AST, so
  line numbers in tracebacks match what the model wrote.

Result text: stdout when the exit status is 0 (empty output is a valid result); otherwise stdout
followed by the tail of stderr (the traceback); runs ended by a signal, a timeout, a limit or the output
cap get a readable message and `error` set. bwrap reports a death by signal N as exit status 128+N, so
a program that itself exits with such a status is reported as killed by that signal. The interpreter
runs with `-s -B` rather than `-I` so that PYTHONHASHSEED and unbuffered output (partial output
survives a kill) can be set through the environment, which is built from scratch anyway.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import time
from typing import Optional

from megatron_arpo.tools.base import Tool, ToolResult
from megatron_arpo.tools.config import MAX_CAPTURE_BYTES
from megatron_arpo.tools.containment import (
    BASE_TASKS, BWRAP_ENV, BwrapCommand, Limits, RlimitsCommand, SandboxUnavailable, SandboxUser,
)
from megatron_arpo.tools.run_limits import (
    INODE_BYTES, MAX_SCRATCH_FILES, METER_INTERVAL_S, RunCgroup, SandboxInit, Usage, find_cgroup_parent, sample_usage,
)

logger = logging.getLogger(__name__)

_MAX_CODE_BYTES = 100_000  # one argv string may hold at most 128 KiB on Linux
SANDBOX_MODES = ("required", "best_effort")
CGROUP_MODES = ("auto", "required", "off")


def add_auto_print(code: str) -> str:
    """Wrap the last top-level expression in print(...) unless it already is a bare print call."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return code  # the interpreter in the sandbox reports it to the model
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return code
    expr = tree.body[-1].value
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "print":
        return code
    lines = code.splitlines(keepends=True)
    # ast offsets are in UTF-8 bytes per line; convert the start and end positions to str indices.
    def to_index(lineno: int, col: int) -> int:
        before = sum(len(line) for line in lines[: lineno - 1])
        return before + len(lines[lineno - 1].encode("utf-8")[:col].decode("utf-8", errors="ignore"))

    start = to_index(expr.lineno, expr.col_offset)
    end = to_index(expr.end_lineno, expr.end_col_offset)
    return code[:start] + "print(" + code[start:end] + ")" + code[end:]


def check_code(code: str) -> Optional[ToolResult]:
    """A tool error for code that cannot be handed to an interpreter at all (None when it can): a NUL
    byte cannot be in an argv string, and a lone surrogate is no UTF-8 text."""
    if "\x00" in code:
        return ToolResult(text="Error: the code contains a NUL byte (\\x00); remove it.", error="invalid code")
    try:
        code.encode("utf-8")
    except UnicodeEncodeError as exc:
        return ToolResult(text=f"Error: the code is not valid Unicode text (lone surrogate {code[exc.start]!r} at "
                               f"character {exc.start}); remove it.", error="invalid code")
    if len(code) > _MAX_CODE_BYTES:
        return ToolResult(text=f"Error: the code is longer than {_MAX_CODE_BYTES} bytes; split it into smaller "
                               "cells.", error="code too long")
    return None


def _truncate_head(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [output truncated: {len(text) - limit} more characters]"


def _truncate_tail(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"[... {len(text) - limit} earlier characters truncated]\n" + text[-limit:]


_SIGNAL_HINTS = {
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGKILL: "killed: out of memory, CPU time or another resource limit",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGXFSZ: "file size limit exceeded",
    signal.SIGABRT: "aborted",
}



@dataclasses.dataclass
class _Outcome:
    stdout: bytes
    stderr: bytes
    returncode: Optional[int]
    stopped: Optional[str]  # timeout | cpu | memory | None
    capped: bool
    peak: Usage
    started: bool = True  # False when the sandbox failed before the program ran
    oom_kills: int = 0


class _StatusPipe:
    """bwrap's --json-status-fd, read on the event loop: `child-pid` first, `exit-code` once the program ran."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffer = b""
        self.eof = False
        self.changed = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        os.set_blocking(fd, False)
        self.loop.add_reader(fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        if data:
            self.buffer += data
        else:
            self.eof = True
            self.loop.remove_reader(self.fd)
        self.changed.set()

    def documents(self) -> list[dict]:
        docs = []
        for line in self.buffer.splitlines():
            try:
                docs.append(json.loads(line))
            except ValueError:
                continue
        return docs

    async def child_pid(self) -> Optional[int]:
        while b"\n" not in self.buffer and not self.eof:
            self.changed.clear()
            await self.changed.wait()
        docs = self.documents()
        return docs[0].get("child-pid") if docs else None

    async def finish(self, timeout_s: float) -> list[dict]:
        try:
            while not self.eof:
                self.changed.clear()
                await asyncio.wait_for(self.changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self.documents()

    def close(self) -> None:
        if not self.eof:
            self.loop.remove_reader(self.fd)
        os.close(self.fd)


class PythonSandboxTool(Tool):
    """Runs model-written Python in an isolated, limited, throw-away sandbox. See the module docstring."""

    cacheable = False

    def __init__(
        self,
        *,
        tag: str = "python",
        timeout_s: float = 10.0,
        cpu_s: Optional[int] = None,
        memory_mb: int = 2048,
        file_size_mb: int = 32,
        disk_mb: int = 64,
        nproc: int = 32,
        max_output_chars: int = 4000,
        max_capture_bytes: int = 1 << 20,
        user: Optional[str] = "nobody",
        python_executable: Optional[str] = None,
        isolate_network: bool = True,
        auto_print: bool = True,
        sandbox: str = "required",
        cgroup: str = "auto",
        cgroup_parent: Optional[str] = None,
    ):
        self.tag = tag
        self.timeout_s = float(timeout_s)
        self.cpu_s = int(cpu_s) if cpu_s is not None else max(1, int(timeout_s + 0.999))
        self.memory_bytes = int(memory_mb) * 1024 * 1024
        self.nproc = int(nproc)
        self.max_output_chars = int(max_output_chars)
        self.max_capture_bytes = int(max_capture_bytes)
        self.auto_print = auto_print
        if self.timeout_s <= 0 or self.memory_bytes <= 0 or self.nproc < 1 or self.max_output_chars < 1 or disk_mb < 1:
            raise ValueError(
                f"python sandbox: timeout_s={timeout_s}, memory_mb={memory_mb}, disk_mb={disk_mb}, nproc={nproc} "
                f"and max_output_chars={max_output_chars} must all be positive"
            )
        if not 1 <= self.max_capture_bytes <= MAX_CAPTURE_BYTES:
            raise ValueError(f"python sandbox: max_capture_bytes={max_capture_bytes} is out of range; allowed: 1 to "
                             f"{MAX_CAPTURE_BYTES} (the output of every call in flight is held in memory)")
        if sandbox not in SANDBOX_MODES:
            raise ValueError(f"tools.python.sandbox={sandbox!r}; allowed values are {list(SANDBOX_MODES)}")
        if cgroup not in CGROUP_MODES:
            raise ValueError(f"tools.python.cgroup={cgroup!r}; allowed values are {list(CGROUP_MODES)}")
        if cgroup == "off" and cgroup_parent:
            raise ValueError("tools.python.cgroup_parent is set but tools.python.cgroup is 'off'; drop one of them")
        # Default: the trainer's base interpreter (its stdlib only, not the trainer's venv packages). An
        # explicit interpreter is used as given, so a venv made for the model's code (numpy, sympy) works.
        python = os.path.realpath(sys.executable) if python_executable is None else os.path.abspath(python_executable)
        if not os.path.isfile(python):
            raise ValueError(f"python sandbox: interpreter {python} does not exist; set tools.python.python_executable")
        self.user = SandboxUser.resolve(user)
        limits = Limits(cpu_s=self.cpu_s, memory_bytes=self.memory_bytes, file_size_bytes=int(file_size_mb) << 20,
                        nproc=self.nproc, disk_bytes=int(disk_mb) << 20)
        try:
            self.command = BwrapCommand(python, self.user, limits, isolate_network=isolate_network)
            self.command.probe()
        except SandboxUnavailable as exc:
            if sandbox == "required":
                raise SandboxUnavailable(
                    f"python sandbox (tools.python.sandbox: required): {exc}. Fix that, or set "
                    "tools.python.sandbox: best_effort to run model code WITHOUT isolation (not recommended)"
                ) from exc
            self.command = RlimitsCommand(python, self.user, limits)
            logger.warning("python sandbox: tools.python.sandbox is best_effort and the sandbox is unavailable "
                           "(%s); running model code with %s", exc, self.command.describe())
        self.cgroup_parent = None
        memory = "meter over all processes (sampled every %.1f s) + RLIMIT_AS per process" % METER_INTERVAL_S
        if cgroup != "off":
            parent, why = find_cgroup_parent(cgroup_parent) if self.command.kind == "bwrap" else (None, "no sandbox")
            if parent is None and (cgroup == "required" or cgroup_parent):
                raise ValueError(f"python sandbox: no memory cgroup for the runs (tools.python.cgroup: {cgroup}): "
                                 f"{why}; see docs/sandbox.md on cgroup delegation, or set tools.python.cgroup: auto")
            if parent is not None:
                parent.sweep_stale()
                self.cgroup_parent = parent
                memory = f"{parent.describe()} (hard) + meter + RLIMIT_AS per process"
            else:
                logger.info("python sandbox: no memory cgroup for the runs (%s); memory is bounded by the meter "
                            "and RLIMIT_AS per process", why)
        self.isolation = {
            "mode": self.command.kind,
            "user": self.user.name,
            "uid": self.user.uid,
            "network_isolated": self.command.kind == "bwrap" and isolate_network,
            "memory": memory,
            "description": self.command.describe(),
            "binds": list(getattr(self.command, "binds", [])),
        }
        logger.info("python sandbox: %s; memory: %s", self.command.describe(), memory)

    async def execute(self, query: str) -> ToolResult:
        start = time.monotonic()
        refused = check_code(query)
        if refused is not None:
            return refused
        code = add_auto_print(query) if self.auto_print else query
        if len(code.encode("utf-8")) > _MAX_CODE_BYTES:
            return ToolResult(
                text=f"Error: the code is longer than {_MAX_CODE_BYTES} bytes; split it into smaller cells.",
                error="code too long",
            )
        if self.command.kind == "bwrap":
            outcome = await self._run_bwrap(code)
        else:
            outcome = await self._run_plain(code)
        result = self._format(outcome)
        result.latency_s = time.monotonic() - start
        return result

    async def _run_bwrap(self, code: str) -> _Outcome:
        status_r, status_w = os.pipe()
        block_r = block_w = seccomp_fd = -1
        run_cgroup: Optional[RunCgroup] = None
        init: Optional[SandboxInit] = None
        status = None
        try:
            if self.cgroup_parent is not None:
                block_r, block_w = os.pipe()
                run_cgroup = await asyncio.to_thread(self.cgroup_parent.create, self.memory_bytes,
                                                     self.nproc + BASE_TASKS)
            seccomp = self.command.seccomp_fd()
            seccomp_fd = -1 if seccomp is None else seccomp
            argv = self.command.argv(code, status_fd=status_w, block_fd=block_r if run_cgroup else None,
                                     seccomp_fd=seccomp)
            kwargs = self.command.spawn_kwargs()
            pass_fds = (*kwargs.pop("pass_fds"), status_w, *((block_r,) if run_cgroup else ()),
                        *((seccomp_fd,) if seccomp_fd >= 0 else ()))
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True, pass_fds=pass_fds, env=BWRAP_ENV,
                cwd="/", **kwargs,
            )
            for fd in (status_w, block_r, seccomp_fd):
                if fd >= 0:
                    os.close(fd)
            status_w = block_r = seccomp_fd = -1
            status = _StatusPipe(status_r)
            status_r = -1

            def kill() -> None:
                # The init by its pidfd (the run may have cleared the init's parent-death signal); the
                # monitor reaps it and exits. Without a held init, the monitor (its death kills the init
                # unless that was tampered with). Then whatever is left in the run's cgroup.
                if init is not None and init.fd >= 0:
                    init.kill()
                else:
                    _kill_group(proc)
                if run_cgroup is not None:
                    run_cgroup.kill()

            try:
                child = await asyncio.wait_for(status.child_pid(), timeout=30)
                if child is not None:
                    init = SandboxInit(child, proc.pid)
                    if run_cgroup is not None:
                        # bwrap's PID 1 waits on --block-fd: everything the run starts is inside the cgroup.
                        run_cgroup.add(child)
                        os.write(block_w, b"1")
                outcome = await self._collect(proc, kill, init)
            except BaseException:
                kill()
                raise
            finally:
                kill()  # the program has ended (or is being stopped): nothing of the run may outlive it
                if init is not None and not await init.wait(timeout_s=10.0):
                    logger.warning("python sandbox: the init of a run (pid %d) did not exit after SIGKILL", init.pid)
                _kill_group(proc)
                if proc.returncode is None:
                    await _wait_exit(proc)
                transport = getattr(proc, "_transport", None)  # no public close on Process
                if transport is not None:
                    transport.close()
            docs = await status.finish(timeout_s=1.0)
            outcome.started = any("exit-code" in doc for doc in docs)
            if outcome.returncode is not None and 128 < outcome.returncode < 128 + signal.NSIG:
                outcome.returncode = 128 - outcome.returncode  # bwrap's 128+N for a death by signal N
            if run_cgroup is not None:
                outcome.oom_kills = run_cgroup.oom_kills()
            return outcome
        finally:
            for fd in (status_r, status_w, block_r, block_w, seccomp_fd):
                if fd >= 0:
                    os.close(fd)
            if status is not None:
                status.close()
            if init is not None:
                init.close()
            if run_cgroup is not None:
                await asyncio.to_thread(run_cgroup.remove)

    async def _run_plain(self, code: str) -> _Outcome:
        scratch = tempfile.mkdtemp(prefix="arpo_sbx_")
        try:
            if self.user.switch:
                os.chown(scratch, self.user.uid, self.user.gid)
            os.chmod(scratch, 0o700)
            argv = await asyncio.to_thread(self.command.argv, code, scratch=scratch)
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True, env=self.command.environment(scratch),
                cwd=scratch, **self.user.spawn_kwargs(),
            )
            try:
                return await self._collect(proc, lambda: _kill_group(proc), None)
            finally:
                _kill_group(proc)
                if proc.returncode is None:
                    await _wait_exit(proc)
                transport = getattr(proc, "_transport", None)
                if transport is not None:
                    transport.close()
        finally:
            await _remove_scratch(scratch)

    async def _collect(self, proc, kill, init: Optional[SandboxInit]) -> _Outcome:
        buffers = {"out": bytearray(), "err": bytearray()}
        state = {"total": 0, "capped": False}
        peak = Usage()
        stopped: Optional[str] = None

        async def pump(stream, name):
            while True:
                chunk = await stream.read(65536)
                if not chunk:
                    return
                room = self.max_capture_bytes - state["total"]
                if room > 0:
                    buffers[name] += chunk[:room]
                state["total"] += len(chunk)
                if state["total"] > self.max_capture_bytes and not state["capped"]:
                    state["capped"] = True
                    kill()  # keep draining so the writer sees EOF, not a full pipe

        async def watch():
            nonlocal stopped
            delay, next_sample = 0.002, time.monotonic() + METER_INTERVAL_S
            while proc.returncode is None:
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.05)
                if proc.returncode is not None or time.monotonic() < next_sample:
                    continue
                usage = sample_usage(proc.pid)
                if init is not None:
                    scratch_bytes, usage.files = init.scratch_usage()
                    usage.memory_bytes += scratch_bytes + usage.files * INODE_BYTES
                peak.cpu_s = max(peak.cpu_s, usage.cpu_s)
                peak.memory_bytes = max(peak.memory_bytes, usage.memory_bytes)
                peak.tasks = max(peak.tasks, usage.tasks)
                if usage.cpu_s > self.cpu_s:
                    stopped = "cpu"
                elif usage.memory_bytes > self.memory_bytes:
                    stopped = "memory"
                elif usage.files > MAX_SCRATCH_FILES:
                    stopped = "files"
                if stopped:
                    kill()
                    return
                next_sample = time.monotonic() + METER_INTERVAL_S

        pumps = asyncio.gather(pump(proc.stdout, "out"), pump(proc.stderr, "err"))
        try:
            try:
                await asyncio.wait_for(watch(), timeout=self.timeout_s)
            except asyncio.TimeoutError:
                stopped = "timeout"
                kill()
            await _wait_exit(proc)
            # In the sandbox the output pipes close with the PID namespace; in the fallback, processes
            # that left the session may hold them open.
            try:
                await asyncio.wait_for(asyncio.shield(pumps), timeout=2.0)
            except asyncio.TimeoutError:
                logger.warning("python sandbox: output pipes of a run stayed open after it ended; dropping them")
                pumps.cancel()
        except BaseException:
            pumps.cancel()
            raise
        return _Outcome(bytes(buffers["out"]), bytes(buffers["err"]), proc.returncode, stopped, state["capped"], peak)

    def _format(self, o: _Outcome) -> ToolResult:
        out = o.stdout.decode("utf-8", errors="replace")
        err = o.stderr.decode("utf-8", errors="replace")
        limit = self.max_output_chars
        truncated = o.capped or len(out) > limit or len(err) > limit
        stops = {
            "timeout": ("timeout", f"TimeoutError: execution exceeded the {self.timeout_s:g} s time limit and was stopped."),
            "cpu": ("cpu limit", f"Error: the run used more than {self.cpu_s} s of CPU time across its processes "
                                 "and was stopped."),
            "memory": ("memory limit", f"Error: the run used more than {self.memory_bytes >> 20} MB of memory "
                                       "across its processes and was stopped."),
            "files": ("file limit", f"Error: the run created more than {MAX_SCRATCH_FILES} files in its scratch "
                                    "space and was stopped."),
        }
        if o.stopped in stops:
            error, message = stops[o.stopped]
            text = _truncate_head(out.strip(), limit)
            return ToolResult(text=(text + "\n" + message).strip(), error=error, truncated=truncated)
        if o.capped:
            text = _truncate_head(out, limit).rstrip()
            message = (
                f"[output truncated: the program printed more than {self.max_capture_bytes} bytes "
                "and was stopped]"
            )
            return ToolResult(text=text + "\n" + message, error="output limit", truncated=True)
        if not o.started:
            logger.warning("python sandbox: a run failed before the program started (status %s): %s",
                           o.returncode, err.strip()[-500:])
            return ToolResult(text="Error: the python sandbox could not start this run; try again.",
                              error="sandbox failure")
        if o.returncode == 0:
            text = _truncate_head(out.strip(), limit)
            if o.oom_kills:
                text += (f"\n[note: {o.oom_kills} process(es) of this run were killed at its memory limit of "
                         f"{self.memory_bytes >> 20} MB]")
            return ToolResult(text=text, truncated=truncated)
        parts = []
        if out.strip():
            parts.append(_truncate_head(out.strip(), limit // 2))
        if err.strip():
            parts.append(_truncate_tail(err.strip(), limit if not parts else limit - limit // 2))
        if o.oom_kills:
            parts.append(f"Error: the run reached its memory limit of {self.memory_bytes >> 20} MB "
                         f"({o.oom_kills} process(es) killed).")
            return ToolResult(text="\n".join(parts), error="memory limit", truncated=truncated)
        if o.returncode is not None and o.returncode < 0:
            signum = -o.returncode
            try:
                name = signal.Signals(signum).name
            except ValueError:
                name = f"signal {signum}"
            hint = _SIGNAL_HINTS.get(signum, "terminated by a signal")
            if signum == signal.SIGXCPU:
                hint = f"CPU time limit of {self.cpu_s} s exceeded"
            parts.append(f"Error: the program was killed by {name} ({hint}).")
            return ToolResult(text="\n".join(parts), error=f"killed by {name}", truncated=truncated)
        if not parts:
            parts.append(f"Error: the program exited with status {o.returncode} and printed nothing.")
        return ToolResult(text="\n".join(parts), error=f"exit status {o.returncode}", truncated=truncated)

    async def close(self) -> None:
        self.command.close()


def _kill_group(proc) -> None:
    # Only while the leader is unreaped: its pid (= the group id) cannot have been reused yet. For a
    # sandbox run the leader is bwrap's monitor; the run's init is killed through its pidfd.
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


async def _remove_scratch(path: str) -> None:
    """Remove the fallback's scratch dir; `rm` copes with any depth and does not follow symlinks."""
    for argv in (["rm", "-rf", "--", path], ["chmod", "-R", "u+rwX", "--", path], ["rm", "-rf", "--", path]):
        if not os.path.exists(path):
            return
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL,
                                                    stderr=asyncio.subprocess.DEVNULL)
        await proc.wait()
    if os.path.exists(path):
        logger.warning("python sandbox: could not remove the scratch directory %s", path)


async def _wait_exit(proc) -> int:
    """Wait until the program itself has exited.

    `Process.wait()` in Python 3.11 also waits for the output pipes to close, which never happens
    while a detached grandchild holds them; the return code is set as soon as the child is reaped.
    """
    delay = 0.002
    while proc.returncode is None:
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
    return proc.returncode
