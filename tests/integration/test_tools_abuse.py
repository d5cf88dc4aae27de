"""The python sandbox under abuse, through the rollout's entry point, for a root and a non-root trainer.

Every test runs the code the way the rollout does (`build_tools`, then `executor.execute("python",
code)`, see sandbox_harness.py) inside a separate trainer process, once per trainer kind:
- `root`: the trainer runs as root (the sandboxed code then runs as `nobody`);
- `unprivileged`: the trainer runs as an unprivileged account (created once with useradd when the
  suite runs as root; the current user otherwise), with its own HOME holding a ~/.netrc secret.
Both trainers carry a WANDB_API_KEY secret in their environment.

Each case here was found by a red-team pass on the previous sandbox; the pass criterion is that every
normal run is correct, no abuse crosses runs, nothing survives its run, and the limits hold for a run
as a whole. Lingering processes are found by a unique tag written into each program: it is in the
command line (`python -c CODE`) of the program and of every process it forks.
"""

import json
import os
import platform
import pwd
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import psutil
import pytest

pytestmark = pytest.mark.timeout(300)

HERE = os.path.dirname(os.path.abspath(__file__))
HARNESS = os.path.join(HERE, "sandbox_harness.py")
REPO = os.path.dirname(os.path.dirname(HERE))
IS_ROOT = os.geteuid() == 0
TEST_USER = "arpo-sbx-test"
SECRET = f"arpo-secret-{uuid.uuid4().hex}"
TOOL = {"timeout_s": 5, "cpu_s": 5, "memory_mb": 256, "nproc": 16, "disk_mb": 16, "max_output_chars": 2000,
        "max_capture_bytes": 256 * 1024}

if shutil.which("bwrap") is None:
    pytest.skip("bubblewrap (bwrap) is not installed; `make test` installs it", allow_module_level=True)


# ------------------------------------------------------------------------------------ trainers
def _ensure_test_user() -> tuple[int, int]:
    """An unprivileged system account for the non-root trainer. It is kept afterwards: concurrent test
    sessions on the same machine share it, and removing it under them would break their runs."""
    try:
        entry = pwd.getpwnam(TEST_USER)
    except KeyError:
        if shutil.which("useradd") is None:
            pytest.skip("useradd is not available to create an unprivileged test account")
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", "/nonexistent",
                        "--shell", "/usr/sbin/nologin", TEST_USER], capture_output=True)
        entry = pwd.getpwnam(TEST_USER)  # created now, or by a concurrent session
    return entry.pw_uid, entry.pw_gid


@pytest.fixture(scope="session")
def unprivileged_identity():
    """(uid, gid, python) of the non-root trainer; skips when it cannot run the harness."""
    if not IS_ROOT:
        return os.getuid(), os.getgid(), sys.executable
    uid, gid = _ensure_test_user()
    python = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
    if python is None:
        pytest.skip("no system python3 the unprivileged account can run (the venv's interpreter is under /root)")
    check = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--", python, "-c",
                            f"import sys; sys.path.insert(0, {REPO!r}); import megatron_arpo.tools.registry"],
                           capture_output=True, text=True, cwd="/")
    if check.returncode != 0:
        pytest.skip(f"the unprivileged account cannot import the checkout at {REPO}: {check.stderr.strip()[-200:]}")
    return uid, gid, python


class Trainer:
    """A trainer process that runs tool calls; its HOME holds a .netrc with the secret."""

    def __init__(self, kind: str, workspace: str, home: str, argv_prefix: list[str], python: str, uid: int):
        self.kind = kind
        self.workspace = workspace
        self.home = home
        self.netrc = os.path.join(home, ".netrc")
        self.argv_prefix = argv_prefix
        self.python = python
        self.uid = uid
        self.isolation: dict = {}
        self.stderr = ""

    def environment(self) -> dict:
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": self.home, "LANG": "C.UTF-8",
                "WANDB_API_KEY": SECRET, "TMPDIR": os.path.join(self.home, "tmp")}

    def call(self, codes, *, concurrent=False, executor_timeout_s=60.0, wrapper=(), harness=None, **tool):
        request = {"tool": {**TOOL, **tool}, "codes": list(codes), "concurrent": concurrent,
                   "executor_timeout_s": executor_timeout_s, **(harness or {})}
        done = subprocess.run([*self.argv_prefix, *wrapper, self.python, HARNESS], input=json.dumps(request),
                              capture_output=True, text=True, env=self.environment(), cwd=self.home, timeout=280)
        self.stderr = done.stderr
        try:
            answer = json.loads(done.stdout)
        except ValueError:
            raise AssertionError(f"harness failed (status {done.returncode}): {done.stderr[-3000:]}") from None
        if "exception" in answer:
            return answer["exception"]
        self.isolation = answer["isolation"]
        self.pid = answer.get("pid")
        self.trainer_key_after = answer.get("trainer_key_after")
        return answer["results"]


@pytest.fixture(scope="session")
def workspace_root():
    """A base directory every trainer account can traverse (pytest's own tmp dirs are private to root)."""
    root = tempfile.mkdtemp(prefix="arpo_abuse_")
    os.chmod(root, 0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=["root", "unprivileged"])
def trainer(request, workspace_root, unprivileged_identity):
    workspace = tempfile.mkdtemp(dir=workspace_root)
    os.chmod(workspace, 0o755)
    home = os.path.join(workspace, "home")
    os.makedirs(os.path.join(home, "tmp"))
    with open(os.path.join(home, ".netrc"), "w") as handle:
        handle.write(f"machine api.wandb.ai\n  login user\n  password {SECRET}\n")
    if request.param == "root":
        if not IS_ROOT:
            pytest.skip("the suite does not run as root")
        os.chmod(home, 0o700)
        return Trainer("root", workspace, home, [], sys.executable, 0)
    uid, gid, python = unprivileged_identity
    prefix = []
    if IS_ROOT:
        for path in (home, os.path.join(home, "tmp"), os.path.join(home, ".netrc")):
            os.chown(path, uid, gid)
        prefix = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    os.chmod(home, 0o700)
    return Trainer("unprivileged", workspace, home, prefix, python, uid)


# ------------------------------------------------------------------------------------ helpers
def tagged(code):
    tag = f"arpo_abuse_{uuid.uuid4().hex}"
    return f"# {tag}\n{code}", tag


def processes_with(*tags, wait_s=3.0):
    """Live processes whose command line holds one of the tags, after waiting up to `wait_s` for them
    to disappear (the kernel tears a PID namespace down asynchronously)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for proc in psutil.process_iter(["cmdline", "status"]):
            try:
                cmdline = " ".join(proc.info["cmdline"] or [])
            except psutil.Error:
                continue
            if any(tag in cmdline for tag in tags) and proc.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(proc.pid)
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def code_user(trainer):
    return pwd.getpwnam("nobody").pw_uid if trainer.kind == "root" else trainer.uid


# ------------------------------------------------------------------------------------ basics
def test_normal_runs_errors_and_identity(trainer):
    results = trainer.call([
        "a=[1,2]\nlen(a)",
        "x = 1",
        "def f():\n    raise ValueError('bad input')\nf()",
        "import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)",
        "import ctypes, os\n"
        "fields = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(os.getuid(), os.geteuid(), fields['CapEff'].strip(), fields['NoNewPrivs'].strip(), "
        "libc.unshare(0x10000000))",
    ])
    assert trainer.isolation["mode"] == "bwrap"
    assert results[0] == {"text": "2", "error": None, "truncated": False}
    assert results[1]["error"] is None and results[1]["text"] == ""
    assert results[2]["error"] == "exit status 1"
    assert "ValueError: bad input" in results[2]["text"] and "line 2, in f" in results[2]["text"]
    assert results[3]["error"] == "killed by SIGKILL" and results[3]["text"].startswith("before")
    uid = code_user(trainer)
    # never root, no capabilities, no_new_privs, and no further user namespaces
    assert results[4]["text"] == f"{uid} {uid} 0000000000000000 1 -1", results[4]


def test_timeouts_stop_the_run_and_everything_in_it(trainer):
    loop, loop_tag = tagged("while True: pass")
    sleeper, sleeper_tag = tagged("import time\nprint('started', flush=True)\ntime.sleep(600)")
    results = trainer.call([loop, sleeper], timeout_s=2, cpu_s=2)
    assert results[0]["error"] in ("timeout", "killed by SIGXCPU", "cpu limit")
    assert results[1]["error"] == "timeout"
    assert results[1]["text"].startswith("started") and "exceeded the 2 s time limit" in results[1]["text"]
    # the executor's own timeout (shorter than the tool's) also ends the sandbox
    stuck, stuck_tag = tagged("import time\ntime.sleep(600)")
    results = trainer.call([stuck], executor_timeout_s=1.0, timeout_s=60)
    assert results[0]["error"] == "timeout"
    assert processes_with(loop_tag, sleeper_tag, stuck_tag) == []


def test_huge_output_is_truncated(trainer):
    codes = [tagged(c) for c in ("print('x' * 10**8)", "while True:\n    print('y' * 1000)")]
    for result in trainer.call([c for c, _ in codes]):
        assert result["truncated"] and "truncated" in result["text"]
        assert len(result["text"]) < 2000 + 300  # max_output_chars plus the markers
    assert processes_with(*(t for _, t in codes)) == []


# ------------------------------------------------------------------------------------ processes
DETACH = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.environ.clear()
        for fd in (0, 1, 2):
            os.close(fd)  # let the run's output pipes close
        while True:
            for path in ("/tmp/result.txt", "/dev/shm/result.txt"):
                try:
                    open(path, "w").write("FORGED")
                except OSError:
                    pass
            time.sleep(0.05)
    os._exit(0)
time.sleep(0.3)
print("parent done")
"""
CHECK_FORGED = ("import os\nprint([open(p).read() for p in ('/tmp/result.txt', '/dev/shm/result.txt') "
                "if os.path.exists(p)])")


def test_detached_children_die_with_their_run_and_forge_nothing(trainer):
    detach, tag = tagged(DETACH)
    results = trainer.call([detach])
    assert results[0] == {"text": "parent done", "error": None, "truncated": False}
    assert processes_with(tag) == []
    assert [r["text"] for r in trainer.call([CHECK_FORGED] * 3)] == ["[]"] * 3


def test_fork_bomb_is_contained(trainer):
    bomb, tag = tagged("import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
                       "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
                       "except OSError as exc:\n    print('forked', n, exc.errno)")
    results = trainer.call([bomb], nproc=16)
    assert results[0]["error"] is None
    forked, errno = results[0]["text"].split()[1:]
    assert int(forked) <= 16 and errno == "11"  # EAGAIN: the run's own process budget
    assert processes_with(tag) == []


# A run ptraces its own bwrap init (PID 1: same user, dumpable) and makes it call
# prctl(PR_SET_PDEATHSIG, 0), so that the init no longer dies with the bwrap monitor; then it leaves a
# detached child and outlives its timeout.
DISARM_INIT = r"""
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
libc.ptrace.restype = ctypes.c_long
class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in ("r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi "
                                                  "orig_rax rip cs eflags rsp ss fs_base gs_base ds es fs gs").split()]
def pt(request, addr=None, data=None):
    if libc.ptrace(request, 1, addr, data) == -1:
        raise OSError(ctypes.get_errno(), "ptrace")
try:
    pt(16)  # PTRACE_ATTACH
    os.waitpid(1, 0x40000000)
    saved, regs = Regs(), Regs()
    pt(12, None, ctypes.addressof(saved))  # GETREGS: the init sits in wait4, just after a syscall instruction
    ctypes.memmove(ctypes.addressof(regs), ctypes.addressof(saved), ctypes.sizeof(Regs))
    regs.rip, regs.rax, regs.orig_rax, regs.rdi, regs.rsi = saved.rip - 2, 157, 2**64 - 1, 1, 0  # prctl
    pt(13, None, ctypes.addressof(regs))
    pt(9)  # SINGLESTEP over the syscall
    os.waitpid(1, 0x40000000)
    pt(12, None, ctypes.addressof(regs))
    pt(13, None, ctypes.addressof(saved))
    pt(17)  # DETACH
    print("disarmed", ctypes.c_longlong(regs.rax).value, flush=True)
except OSError as exc:
    print("ptrace", exc.errno, flush=True)
if os.fork() == 0:
    os.setsid()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while True:
        time.sleep(0.1)
time.sleep(600)
"""


def run_cgroups(trainer):
    """Names of the per-run cgroups the last harness made that still exist (none without a cgroup)."""
    match = re.search(r"cgroup v\d under (\S+)", trainer.isolation.get("memory", ""))
    if match is None:
        return []
    return [n for n in os.listdir(match.group(1)) if n.startswith(f"arpo-sbx-{trainer.pid}-")]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the attack injects an x86-64 system call")
@pytest.mark.parametrize("seccomp", [True, False], ids=["seccomp", "init-tampered"])
def test_a_run_that_disarms_its_init_leaves_nothing_behind(trainer, seccomp):
    attack, tag = tagged(DISARM_INIT)
    result = trainer.call([attack], timeout_s=2, cpu_s=2, harness={"no_seccomp": not seccomp})[0]
    assert result["error"] == "timeout", result
    # with the filter the attack cannot start; without it, it succeeds and the run still ends
    assert result["text"].startswith("ptrace 1" if seccomp else "disarmed 0"), result
    assert processes_with(tag) == []  # after execute() returned, and after the trainer exited
    assert run_cgroups(trainer) == []


KEYRING = r"""
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
keyctl, add_key = {"x86_64": (250, 248), "aarch64": (219, 217)}[platform.machine()]
def call(*args):
    result = libc.syscall(*args)
    return result if result >= 0 else -ctypes.get_errno()
buffer = ctypes.create_string_buffer(256)
found = call(keyctl, 10, -3, b"user", b"arpo-trainer-secret", 0)  # KEYCTL_SEARCH in the session keyring
print("search", found, "read", call(keyctl, 11, __TRAINER_KEY__, buffer, 256), buffer.value.decode())
print("revoke", call(keyctl, 3, __TRAINER_KEY__), "plant", call(add_key, b"user", b"arpo-planted", b"x", 1, -3))
print("planted before", call(keyctl, 10, -3, b"user", b"arpo-planted", 0))
try:
    listed = "arpo" in open("/proc/keys").read()
except OSError:
    listed = False
print("listed", listed, "ptrace", libc.ptrace(16, 1, None, None), ctypes.get_errno())
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="key system call numbers")
def test_keyrings_and_ptrace_are_out_of_reach(trainer):
    results = trainer.call([KEYRING, KEYRING], harness={"trainer_key": SECRET})
    for result in results:
        lines = result["text"].splitlines()
        # EPERM (1) for every key operation and for ptrace, nothing listed in /proc/keys
        assert lines[:2] == ["search -1 read -1 ", "revoke -1 plant -1"], result
        assert lines[2:] == ["planted before -1", "listed False ptrace -1 1"], result
        assert SECRET not in result["text"]
    assert trainer.trainer_key_after == SECRET  # neither read nor revoked


SHARED_MEMORY = {
    "memfd": "import os, time\nfds = [os.memfd_create(str(i)) for i in range(40)]\nfor fd in fds:\n"
             "    os.write(fd, b'x' * (8 << 20))\nprint('held memfds')\ntime.sleep(3)",
    # shared anonymous maps, written in small pieces: no anonymous memory to speak of
    "shmem": "import mmap, os, time\npiece = b'x' * (1 << 20)\nfor i in range(5):\n    if os.fork() == 0:\n"
             "        m = mmap.mmap(-1, 50 << 20, flags=mmap.MAP_SHARED)\n        for k in range(50):\n"
             "            m.write(piece)\n        time.sleep(5)\n        os._exit(0)\ntime.sleep(5)\n"
             "print('held shared maps')",
    "inodes": "import time\nfor n in range(200000):\n    open(f'/tmp/f{n}', 'w').close()\n"
              "print('held files')\ntime.sleep(3)",
}


def test_shared_memory_and_files_count_without_a_cgroup(trainer):
    attacks = [tagged(code) for code in SHARED_MEMORY.values()]
    results = trainer.call([c for c, _ in attacks] + ["import resource\nresource.getrlimit(resource.RLIMIT_NOFILE)"],
                           cgroup="off", memory_mb=128, timeout_s=20, file_size_mb=16)
    by_name = dict(zip(SHARED_MEMORY, results))
    assert by_name["memfd"]["error"] == "memory limit", by_name["memfd"]
    assert by_name["shmem"]["error"] == "memory limit", by_name["shmem"]
    assert by_name["inodes"]["error"] in ("file limit", "memory limit"), by_name["inodes"]
    assert results[-1]["text"] == "(1024, 1024)"  # RLIMIT_NOFILE, not the trainer's
    assert processes_with(*(t for _, t in attacks)) == []


def test_pathological_code_is_a_tool_error_without_a_traceback(trainer):
    codes = ["print(1)\x00", "x = '\ud800'\nx", "-" * 90_000 + "1", "a = [0]\na" + "[0]" * 30_000, "(" * 5000 + ")" * 5000]
    results = trainer.call(codes)
    assert [r["error"] for r in results] == ["invalid code", "invalid code"] + ["exit status 1"] * 3, results
    assert "NUL byte" in results[0]["text"] and "lone surrogate" in results[1]["text"]
    assert "Traceback" not in trainer.stderr and "raised on query" not in trainer.stderr, trainer.stderr[-2000:]


# ------------------------------------------------------------------------------------ limits per run
MEMORY = """
import os, time
pids = []
for i in range(3):
    p = os.fork()
    if p == 0:
        block = b"x" * (60 << 20)
        time.sleep(2)
        os._exit(0)
    pids.append(p)
print("statuses", [os.waitpid(p, 0)[1] for p in pids])
"""
CPU = """
import os, time
for i in range(3):
    if os.fork() == 0:
        break
last = 0.0
while True:
    t = time.process_time()
    if t - last >= 0.05:
        # one write(2) per line: the sandbox runs Python unbuffered, where print() writes its parts one by
        # one and the four processes' numbers interleave within a line
        os.write(1, f"{os.getpid()} {t:.3f}\\n".encode())
        last = t
"""
DISK = """
import os
def fill(directory):
    count = 0
    try:
        for i in range(1000):
            with open(f"{directory}/fill{i}", "wb") as f:
                f.write(b"x" * (1 << 20))
            count += 1
    except OSError as exc:
        return count, exc.errno
    return count, None
count, err = fill("/tmp")
shm, shm_err = fill("/dev/shm")
for name in os.listdir("/tmp"):
    os.remove("/tmp/" + name)
try:
    with open("/tmp/big", "wb") as f:
        f.write(b"x" * (5 << 20))
    big = "written"
except OSError as exc:
    big = exc.errno
print(count, err, shm, shm_err, big)
"""
DEEP = "import os\nfor i in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep', len(os.getcwd()))"


def test_memory_is_limited_per_run_not_per_process(trainer):
    memory, tag = tagged(MEMORY)
    result = trainer.call([memory, "x = bytearray(8 * 1024**3)"], memory_mb=128, timeout_s=20)
    # three processes of 60 MB each cannot all hold their memory under a 128 MB run limit: the run is
    # stopped (meter), or some of them are killed (cgroup); per-process limits alone let all three finish.
    assert result[0]["error"] == "memory limit" or ", 9" in result[0]["text"] or "[9" in result[0]["text"], result[0]
    assert "MemoryError" in result[1]["text"]  # one process over the limit: RLIMIT_AS
    assert processes_with(tag) == []


def test_cpu_time_is_limited_per_run_not_per_process(trainer):
    spin, tag = tagged(CPU)
    result = trainer.call([spin], cpu_s=1, timeout_s=60)[0]
    assert result["error"] == "cpu limit", result
    last = {}
    for line in result["text"].splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            last[parts[0]] = float(parts[1])
    # four spinning processes, each reporting its own CPU time: together about the 1 s limit (one meter
    # interval of slack per process), where per-process limits alone would allow 4 s
    assert len(last) >= 2 and sum(last.values()) <= 1.8, last
    assert processes_with(tag) == []


def test_disk_is_limited_per_run_and_deep_trees_vanish(trainer):
    results = trainer.call([DISK, DEEP], disk_mb=8, file_size_mb=4)
    count, err, shm, shm_err, big = results[0]["text"].split()
    assert int(count) <= 8 and err == "28"  # ENOSPC: the run's 8 MB scratch is full
    assert int(shm) <= 16 and shm_err == "28"  # /dev/shm has its own small cap
    assert big == "27"  # EFBIG: one file above file_size_mb
    assert results[1]["error"] is None and results[1]["text"].startswith("deep")


# ------------------------------------------------------------------------------------ reward hacking, secrets
@pytest.fixture
def run_dir(trainer):
    """What a training run keeps on disk, readable by the code's user if it could see it."""
    from pathlib import Path

    root = Path(trainer.workspace) / "run"
    files = {
        "dataset": root / "data" / "train.jsonl",
        "checkpoint": root / "checkpoints" / "step-1" / "model.pt",
        "cache": root / "tool_cache.sqlite",
    }
    for name, path in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"GROUND-TRUTH-{name}-{SECRET}")
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for filename in filenames:
            os.chmod(os.path.join(dirpath, filename), 0o644)
    if trainer.kind == "unprivileged" and IS_ROOT:
        for dirpath, _, filenames in os.walk(root):
            os.chown(dirpath, trainer.uid, -1)
            for filename in filenames:
                os.chown(os.path.join(dirpath, filename), trainer.uid, -1)
    return root, {k: str(v) for k, v in files.items()}


def test_training_data_checkpoints_cache_and_source_are_out_of_reach(trainer, run_dir):
    root, files = run_dir
    targets = dict(files, source=os.path.join(REPO, "megatron_arpo", "train.py"))
    writes = [os.path.dirname(files["checkpoint"]), str(root), REPO, trainer.home]
    code = "\n".join([
        "import os",
        f"for name, path in {sorted(targets.items())!r}:",
        "    try:",
        "        print(name, 'READ', open(path).read())",
        "    except OSError as exc:",
        "        print(name, type(exc).__name__)",
        f"for path in {writes!r}:",
        "    try:",
        "        open(os.path.join(path, 'planted.txt'), 'w').write('pwned')",
        "        print('WROTE', path)",
        "    except OSError as exc:",
        "        print('write', type(exc).__name__)",
        "print(sorted(os.listdir('/')))",
    ])
    before = {path: sorted(os.listdir(path)) for path in writes}
    text = trainer.call([code])[0]["text"]
    for name in targets:
        assert f"{name} FileNotFoundError" in text, text
    assert "WROTE" not in text and "GROUND-TRUTH" not in text
    assert {path: sorted(os.listdir(path)) for path in writes} == before
    visible = set(eval(text.splitlines()[-1]))  # noqa: S307 - our own program's repr of a list of names
    bound_tops = {p.split("/")[1] for p in trainer.isolation["binds"]}
    assert visible <= {"tmp", "dev", "proc", "usr", "lib", "lib64", "lib32", "libx32"} | bound_tops, visible
    assert not visible & {"etc", "home", "var", "srv", "mnt", "opt"} - bound_tops


SECRETS = """
import os
secret = {secret!r}
paths = ["/proc/%s/environ" % p for p in os.listdir("/proc") if p.isdigit()]
paths += ["/proc/__TRAINER_PID__/environ", "/proc/%d/environ" % os.getppid(), os.path.expanduser("~/.netrc"),
          {netrc!r}]
hits = []
for path in paths:
    try:
        with open(path, "rb") as handle:
            if secret.encode() in handle.read():
                hits.append(path)
    except OSError:
        pass
print("env", any(secret in value for value in os.environ.values()), "hits", hits)
"""


def test_trainer_secrets_are_out_of_reach(trainer):
    code = SECRETS.format(secret=SECRET, netrc=trainer.netrc)
    result = trainer.call([code])[0]
    assert result["text"] == "env False hits []", result
    assert SECRET not in result["text"]


def test_network_is_unreachable_even_loopback(trainer):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        code = (f"import socket\nprint([name for _, name in socket.if_nameindex()])\n"
                f"socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')")
        result = trainer.call([code])[0]
        # the run's own network namespace: a loopback device of its own and nothing else
        assert result["text"].startswith("['lo']") and "ConnectionRefusedError" in result["text"], result
        assert result["error"] == "exit status 1" and "connected" not in result["text"].splitlines()
        with pytest.raises(BlockingIOError):
            listener.accept()
    finally:
        listener.close()


@pytest.fixture(scope="session")
def policy_venv(workspace_root):
    """A venv made for the model's code (from the system python3), holding one extra package."""
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("no system python3 to make a venv from")
    venv = os.path.join(workspace_root, "policy-venv")
    subprocess.run([python, "-m", "venv", "--without-pip", venv], check=True, capture_output=True)
    site = subprocess.run([os.path.join(venv, "bin", "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(site, "policy_helper.py"), "w") as handle:
        handle.write("def answer():\n    return 42\n")
    for dirpath, dirnames, filenames in os.walk(venv):
        os.chmod(dirpath, 0o755)
    return os.path.join(venv, "bin", "python"), site


def test_a_venv_for_the_code_is_exposed_read_only(trainer, policy_venv):
    python, site = policy_venv
    code = ("import policy_helper, sys\nprint(policy_helper.answer(), sys.prefix)\n"
            f"open({os.path.join(site, 'planted.py')!r}, 'w')")
    result = trainer.call([code], python_executable=python)[0]
    assert result["text"].startswith(f"42 {os.path.dirname(os.path.dirname(python))}\n"), result
    assert "Read-only file system" in result["text"]
    assert not os.path.exists(os.path.join(site, "planted.py"))


# ------------------------------------------------------------------------------------ 16 runs at once
def normal_code(i):
    return f"""
import json, os, time
kids = []
for k in range(3):
    pid = os.fork()
    if pid == 0:
        time.sleep(0.3)
        os._exit(0)
    kids.append(pid)
open('/tmp/mine.txt', 'w').write('{i}')
time.sleep(1.5)
ok = all(os.waitpid(pid, 0)[1] == 0 for pid in kids)
print(json.dumps({{"v": {i} * {i}, "kids": ok, "file": open('/tmp/mine.txt').read()}}))
"""


ATTACKS = {
    "plant_json": """
import glob, os, sys, time
payload = "def dumps(*a, **k):\\n    return 'PWNED'\\nraise SystemExit('PWNED')\\n"
end = time.time() + 1.5
while time.time() < end:
    for d in {"/tmp", "/dev/shm", "/var/tmp", os.getcwd(), *sys.path, *glob.glob("/tmp/*/"), *glob.glob("/tmp/arpo_sbx_*")}:
        try:
            open(os.path.join(d or ".", "json.py"), "w").write(payload)
            open(os.path.join(d or ".", "mine.txt"), "w").write("PWNED")
        except OSError:
            pass
    time.sleep(0.05)
print("planted")
""",
    "kill_all": """
import os, signal, time
me = os.getpid()
end = time.time() + 1.5
while time.time() < end:
    for pid in range(2, 4096):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    time.sleep(0.1)
print("killer done")
""",
    "ptrace": """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
me, attached = os.getpid(), []
for pid in range(1, 4096):
    if pid != me and libc.ptrace(16, pid, None, None) == 0:
        attached.append(pid)
        libc.ptrace(17, pid, None, None)
print("attached", attached)
""",
    "fork_bomb": """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError:
    pass
time.sleep(1.5)
print("bomb", n)
""",
    "memory_hog": "chunks = []\nwhile True:\n    chunks.append(b'x' * (8 << 20))",
    "spin": "import os\nfor i in range(2):\n    os.fork()\nwhile True:\n    pass",
    "detach": DETACH,
    "disk_fill": "n = 0\nwhile True:\n    open(f'/tmp/f{n}', 'wb').write(b'x' * (1 << 20))\n    n += 1",
}


def test_sixteen_concurrent_mixed_runs(trainer):
    normals = [tagged(normal_code(i)) for i in range(8)]
    attacks = [tagged(code) for code in ATTACKS.values()]
    codes = [c for pair in zip(normals, attacks) for c, _ in pair]  # interleaved
    results = trainer.call(codes, concurrent=True, timeout_s=20, cpu_s=3, memory_mb=128, nproc=16, disk_mb=8)
    for i in range(8):
        expected = json.dumps({"v": i * i, "kids": True, "file": str(i)})
        assert results[2 * i] == {"text": expected, "error": None, "truncated": False}, (i, results[2 * i])
    by_name = dict(zip(ATTACKS, results[1::2]))
    # it sees only its own run: at most bwrap's init (PID 1) of its own namespace (attaching can stop
    # that init and so its own run, until the timeout)
    assert by_name["ptrace"]["text"].startswith(("attached []", "attached [1]")), by_name["ptrace"]
    assert by_name["plant_json"]["text"] == "planted"
    assert by_name["memory_hog"]["error"] in ("memory limit", "exit status 1", "killed by SIGKILL")
    assert by_name["spin"]["error"] in ("cpu limit", "timeout", "killed by SIGXCPU")
    assert by_name["disk_fill"]["error"] == "exit status 1" and "No space left" in by_name["disk_fill"]["text"]
    assert processes_with(*(t for _, t in normals + attacks)) == []


# ------------------------------------------------------------------------------------ no user namespaces
def _without_userns(trainer):
    """Wrapper argv: the trainer runs in a user namespace whose user.max_user_namespaces is 0, the state
    of a kernel with unprivileged user namespaces disabled (set per namespace, the host is untouched)."""
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        pytest.skip("util-linux unshare/setpriv are needed to disable user namespaces for one process tree")
    if trainer.kind == "root":
        pytest.skip("a root trainer's sandbox user is set by the host's switches; covered by the unprivileged case")
    return ["unshare", "--user", "--map-user=1000", "--map-group=1000", "--keep-caps", "--", "/bin/sh", "-c",
            'echo 0 > /proc/sys/user/max_user_namespaces && exec setpriv --inh-caps=-all --ambient-caps=-all -- "$@"',
            "sh"]


def test_required_refuses_to_start_without_user_namespaces(trainer):
    answer = trainer.call(["1+1"], wrapper=_without_userns(trainer))
    assert isinstance(answer, str) and answer.startswith("SandboxUnavailable"), answer
    assert "user.max_user_namespaces = 0" in answer and "best_effort" in answer


def test_best_effort_falls_back_warns_and_cleans_up(trainer):
    sleeper, tag = tagged("import time\ntime.sleep(600)")
    results = trainer.call(["1+1", DEEP, sleeper], wrapper=_without_userns(trainer), sandbox="best_effort",
                           timeout_s=2)
    assert trainer.isolation["mode"] == "rlimits-only"
    assert "best_effort and the sandbox is unavailable" in trainer.stderr
    assert "user.max_user_namespaces = 0" in trainer.stderr
    assert results[0]["text"] == "2" and results[1]["text"].startswith("deep") and results[2]["error"] == "timeout"
    assert os.listdir(os.path.join(trainer.home, "tmp")) == []  # the 1200-deep scratch tree is gone
    assert processes_with(tag) == []


def test_tools_python_sandbox_rejects_unknown_modes():
    sys.path.insert(0, REPO)
    from megatron_arpo.tools.python_sandbox import PythonSandboxTool

    with pytest.raises(ValueError, match="allowed values are"):
        PythonSandboxTool(sandbox="sometimes")
    with pytest.raises(ValueError, match="cgroup_parent is set"):
        PythonSandboxTool(cgroup="off", cgroup_parent="/sys/fs/cgroup/x")
    with tempfile.TemporaryDirectory() as directory:
        with pytest.raises(ValueError, match="cgroup_parent"):
            PythonSandboxTool(cgroup_parent=directory)  # not a cgroup v2 directory
