"""Conversion benchmark: throughput against ``cp`` and peak memory against the largest tensor.

Builds synthetic HF checkpoints with QwQ-32B's width (hidden 5120, FFN 27648, 40/8 heads, head_dim 128,
vocab 152064, bf16) and 2, 4 and 8 layers, converts each to Megatron (``--tp 2 --pp 2``) and back with
the real CLI in child processes (start-up and imports included), and prints one table. Every size is
run ``--repeats`` times (default 2), each run with its own ``cp`` next to it. Per run it reports

- MB/s of each direction and of ``cp`` of the same safetensors files in the same run (both fsync'd), and
  ``cp`` of the Megatron files timed right after ``megatron-to-hf`` (that direction's own input),
- the child's peak RSS (``VmHWM``) and peak anonymous RSS (sampled ``RssAnon``: file-backed pages of
  memory-mapped inputs are page cache the kernel can drop) against the largest single tensor,
- that the round trip is bit-exact (every tensor compared).

Every timed command, ``cp`` included, starts after a ``sync``: none pays for an earlier command's writeback.
Each starts with its input in the same state, which the table prints (util-linux ``fincore``): by default
read once right before (warm: in the page cache), with ``--cold`` dropped from the page cache (each reads its
input from disk). Without that, ``cp`` and the conversions would meet inputs in whatever state the previous
command left them (the converters drop their output from the page cache as they write it; ``cp`` does not).

``--width reduced`` (hidden 1024, FFN 3072, 8/2 heads of 128, same vocabulary) with ``--layers 2 16 64``
checks that peak memory does not grow with the layer count.

Disk: about 3x the checkpoint size at a time (source, Megatron, HF output; deleted after each size);
8 layers is ~11 GB of bf16. Usage:
``python benchmarks/conversion.py [--layers 2 4 8] [--width qwq|reduced] [--repeats 2] [--workdir DIR] [--cold]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

QWQ_WIDTH = dict(model_type="qwen2", hidden_size=5120, num_attention_heads=40, num_key_value_heads=8,
                 head_dim=128, intermediate_size=27648, vocab_size=152064, rms_norm_eps=1e-5,
                 rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=False,
                 attention_bias=True, qk_layernorm=False, torch_dtype="bfloat16")
REDUCED_WIDTH = dict(QWQ_WIDTH, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                     intermediate_size=3072)
WIDTHS = {"qwq": QWQ_WIDTH, "reduced": REDUCED_WIDTH}


def build_synthetic(layers: int, out: Path, width: dict = QWQ_WIDTH):
    import torch
    import yaml

    from megatron_arpo.hf import mapping
    from megatron_arpo.hf.checkpoint_io import SafetensorsShardWriter, TensorSpec, write_json
    from megatron_arpo.model_config import hf_config_dict, model_config_from_dict

    cfg = model_config_from_dict(dict(width, name=f"synthetic-{layers}l", num_hidden_layers=layers))
    out.mkdir(parents=True)
    specs = [TensorSpec(name, shape, torch.bfloat16) for rule in mapping.bind_table(cfg)
             for name, shape in rule.hf_shapes(cfg).items() if name in rule.hf_outputs]
    writer = SafetensorsShardWriter(out, specs, 5 * 10**9)
    gen = torch.Generator().manual_seed(layers)
    for spec in specs:
        writer.write(spec.name, torch.empty(spec.shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen))
    writer.close()
    write_json(out / "config.json", hf_config_dict(cfg))
    with open(out.parent / f"{out.name}.yaml", "w") as fh:
        yaml.safe_dump(cfg.to_dict(), fh)
    return cfg, max(s.nbytes for s in specs), sum(s.nbytes for s in specs)


def _peak_child(cmd: list[str]) -> tuple[float, int, int]:
    """Run cmd; return (seconds, peak VmHWM bytes, peak sampled RssAnon bytes)."""
    settle_page_cache()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = {"anon": 0, "hwm": 0}

    def sample():
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as fh:
                    for line in fh:
                        key, _, value = line.partition(":")
                        if key in ("RssAnon", "VmHWM"):
                            kb = int(value.split()[0]) * 1024
                            name = "anon" if key == "RssAnon" else "hwm"
                            peak[name] = max(peak[name], kb)
            except (FileNotFoundError, ProcessLookupError):
                break
            time.sleep(0.05)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    out, err = proc.communicate()
    thread.join()
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd} failed:\n{err[-3000:]}")
    return seconds, peak["hwm"], peak["anon"]


COLD = False  # --cold: every timed command also starts with its input on disk


def settle_page_cache() -> None:
    """Before every timed command: write back every dirty page (``sync``), so that no command pays for an
    earlier one's writeback or for the discards of files deleted before it (this filesystem is mounted with
    ``discard``); with ``--cold`` also drop the page cache (root only), so that each reads its input from disk."""
    os.sync()
    if not COLD:
        return
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")


def prepare_input(directory: Path) -> float:
    """Put ``directory`` (a timed command's input) in the state the mode says: read once (warm) or, with
    ``--cold``, dropped. Returns the fraction of its bytes then resident in the page cache (util-linux
    ``fincore``), or NaN where ``fincore`` is missing."""
    files = [str(p) for p in directory.rglob("*") if p.is_file()]
    if not COLD:
        for name in files:
            with open(name, "rb", buffering=0) as fh:
                while fh.read(16 * 2**20):
                    pass
    settle_page_cache()  # what the timed command will find
    total = sum(os.path.getsize(f) for f in files)
    if not files or not total or shutil.which("fincore") is None:
        return float("nan")
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *files],
                         check=True, capture_output=True, text=True).stdout.split()
    return sum(int(x) for x in out) / total


def _percent(fraction: float) -> str:
    return "n/a" if fraction != fraction else f"{100 * fraction:.0f}%"


def timed_cp(src: Path, dst: Path) -> float:
    settle_page_cache()
    start = time.perf_counter()
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    for path in dst.iterdir():
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - start


def run_once(layers: int, width: dict, work: Path, tp: int, pp: int) -> dict:
    from conversion.verify import compare_hf_dirs

    work.mkdir()
    try:
        cfg, largest, total = build_synthetic(layers, work / "hf", width)
        cached = {"cp": prepare_input(work / "hf")}
        cp_s = timed_cp(work / "hf", work / "cp")
        shutil.rmtree(work / "cp")
        py = [sys.executable, "-m", "conversion"]
        cached["to_mg"] = prepare_input(work / "hf")
        to_mg = _peak_child(py + ["hf-to-megatron", "--hf", str(work / "hf"), "--out", str(work / "mg"),
                                  "--tp", str(tp), "--pp", str(pp), "--model-config", str(work / "hf.yaml")])
        cached["to_hf"] = prepare_input(work / "mg")
        to_hf = _peak_child(py + ["megatron-to-hf", "--megatron", str(work / "mg"), "--out", str(work / "back")])
        # cp of this direction's own input, right after it, its input prepared the same way
        mg_bytes = sum(p.stat().st_size for p in (work / "mg").rglob("*") if p.is_file())
        cached["cp_mg"] = prepare_input(work / "mg")
        cp_mg_s = timed_cp(work / "mg", work / "cp_mg")
        shutil.rmtree(work / "cp_mg")
        exact = not compare_hf_dirs(work / "hf", work / "back")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dict(layers=layers, gb=total / 1e9, largest_gb=largest / 1e9, cp_mbs=total / 1e6 / cp_s,
                to_mg_mbs=total / 1e6 / to_mg[0], to_mg_hwm=to_mg[1] / 1e9, to_mg_anon=to_mg[2] / 1e9,
                to_hf_mbs=total / 1e6 / to_hf[0], to_hf_hwm=to_hf[1] / 1e9, to_hf_anon=to_hf[2] / 1e9,
                to_mg_s=to_mg[0], to_hf_s=to_hf[0], cp_s=cp_s, cp_mg_mbs=mg_bytes / 1e6 / cp_mg_s, cp_mg_s=cp_mg_s,
                exact=exact, cached=cached)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--width", choices=sorted(WIDTHS), default="qwq")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before every timed command (cp included) instead of reading its "
                             "input into it: each one reads its input from disk (needs root)")
    args = parser.parse_args()
    global COLD
    COLD = args.cold
    if COLD and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
        parser.error("--cold drops the page cache through /proc/sys/vm/drop_caches: run it as root")

    rows = []
    base = Path(tempfile.mkdtemp(prefix="conversion-bench-", dir=args.workdir))
    try:
        for layers in args.layers:
            for run in range(1, args.repeats + 1):
                row = dict(run=run, **run_once(layers, WIDTHS[args.width], base / f"l{layers}-r{run}", args.tp,
                                                args.pp))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    cache = ", cold page cache (--cold)" if COLD else ""
    print(f"\n{args.width} width, bf16, TP={args.tp} PP={args.pp}{cache}; RSS = peak VmHWM / peak RssAnon (GB)")
    print("| layers | run | ckpt GB | largest tensor GB | cp MB/s | HF->Megatron MB/s (x cp) | RSS | "
          "Megatron->HF MB/s (x cp) | cp of the Megatron files MB/s (Megatron->HF x it) | RSS | bit-exact | "
          "input cached before cp / HF->Megatron / Megatron->HF / cp of the Megatron files |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['run']} | {r['gb']:.2f} | {r['largest_gb']:.2f} | {r['cp_mbs']:.0f} | "
              f"{r['to_mg_mbs']:.0f} ({r['to_mg_mbs'] / r['cp_mbs']:.2f}) | {r['to_mg_hwm']:.2f} / {r['to_mg_anon']:.2f} | "
              f"{r['to_hf_mbs']:.0f} ({r['to_hf_mbs'] / r['cp_mbs']:.2f}) | "
              f"{r['cp_mg_mbs']:.0f} ({r['to_hf_mbs'] / r['cp_mg_mbs']:.2f}) | "
              f"{r['to_hf_hwm']:.2f} / {r['to_hf_anon']:.2f} | {'yes' if r['exact'] else 'NO'} | "
              f"{' / '.join(_percent(r['cached'][k]) for k in ('cp', 'to_mg', 'to_hf', 'cp_mg'))} |")
    worst = min(min(r['to_mg_mbs'], r['to_hf_mbs']) / r['cp_mbs'] for r in rows)
    print(f"lowest ratio to cp over all rows and both directions: {worst:.2f}")


if __name__ == "__main__":
    main()
