"""Regenerate the install locks: ``constraints/cpu.txt`` and ``constraints/gpu.txt`` (``make lock``).

- cpu: a throwaway venv installs exactly what ``make venv`` installs (torch 2.13.0 CPU build first, then
  ``.[cpu,test]``, minus torchvision/torchaudio/torchcodec), and ``pip freeze`` of it is the lock;
- gpu: pip resolves ``.[gpu,test]`` with ``torch==2.13.0`` for CPython ``--gpu-python`` on x86-64 manylinux
  (``pip install --dry-run --report``: wheels are downloaded for their metadata, nothing is installed).

Both files pin every distribution with ``==`` and are used as pip constraints by the Makefile, so two
installs a week apart get the same packages. Usage: ``python tools/lock.py [--cpu] [--gpu] [--gpu-python 3.11]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "constraints"
CPU_DROPPED = {"torchvision", "torchaudio", "torchcodec", "megatron-arpo"}  # see the Makefile's venv step
PLATFORMS = ("manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(extra: str) -> list[str]:
    """setup.py's base requirements plus one extra and ``test``, read without installing anything."""
    code = ("import runpy, json, setuptools; seen = {}; "
            "setuptools.setup = lambda **kw: seen.update(kw); runpy.run_path('setup.py'); "
            "print(json.dumps([seen['install_requires'], seen['extras_require']]))")
    base, extras = json.loads(subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True,
                                             capture_output=True, text=True).stdout)
    return [*base, *extras[extra], *extras["test"]]


def _write(path: Path, pins: dict[str, str], how: str) -> None:
    header = [f"# {path.name}: every distribution pinned; used by the Makefile as pip constraints.",
              f"# Regenerate with `make lock` ({how}); generated {datetime.date.today().isoformat()}."]
    body = [f"{name}=={version}" for name, version in sorted(pins.items())]
    path.write_text("\n".join(header + body) + "\n")


def lock_cpu() -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="lock-cpu-") as tmp:
        py = Path(tmp) / "bin" / "python"
        subprocess.run([sys.executable, "-m", "venv", tmp], check=True)
        pip = [str(py), "-m", "pip", "install", "--quiet"]
        subprocess.run([*pip, "--upgrade", "pip", "setuptools", "wheel"], check=True)
        subprocess.run([*pip, "torch==2.13.0"], check=True)
        subprocess.run([*pip, *_requirements("cpu")], check=True, cwd=ROOT)
        frozen = subprocess.run([str(py), "-m", "pip", "freeze", "--exclude-editable"], check=True,
                                capture_output=True, text=True).stdout
    pins = {}
    for line in frozen.splitlines():
        name, _, version = line.partition("==")
        if version and _normalise(name) not in CPU_DROPPED:
            pins[_normalise(name)] = version.split("+", 1)[0]  # torch 2.13.0+cpu: the local tag is the build
    return pins


def lock_gpu(python_version: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="lock-gpu-") as tmp:
        report = Path(tmp) / "report.json"
        platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed",
                        "--report", str(report), "--python-version", python_version, *platforms,
                        "--only-binary=:all:", "--target", str(Path(tmp) / "target"), "torch==2.13.0",
                        *_requirements("gpu")], check=True, cwd=ROOT)
        items = json.loads(report.read_text())["install"]
    # A local build tag (this machine's index has torch 2.13.0+cpu) is not part of the pin: a GPU node's index
    # serves the CUDA build of the same version.
    return {_normalise(i["metadata"]["name"]): i["metadata"]["version"].split("+", 1)[0] for i in items
            if _normalise(i["metadata"]["name"]) != "megatron-arpo"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cpu", action="store_true", help="lock the CPU stack (default: both)")
    parser.add_argument("--gpu", action="store_true", help="lock the GPU stack (default: both)")
    parser.add_argument("--gpu-python", default="3.11", help="CPython version the GPU lock is for (default 3.11)")
    args = parser.parse_args()
    both = not (args.cpu or args.gpu)
    OUT.mkdir(exist_ok=True)
    if args.cpu or both:
        _write(OUT / "cpu.txt", lock_cpu(), "fresh venv, torch 2.13.0 CPU build + .[cpu,test]")
    if args.gpu or both:
        _write(OUT / "gpu.txt", lock_gpu(args.gpu_python),
               f"pip's resolution of .[gpu,test] + torch 2.13.0 for CPython {args.gpu_python}, x86-64 manylinux")
    return 0


if __name__ == "__main__":
    sys.exit(main())
