"""What a MoE stage's memory holds, on fake CUDA at real shapes: the census behind the planner's MoE terms.

Two views of one stage's PPO step, as `megatron-arpo plan --measure` runs it (``launchers.measure``,
``megatron_arpo.fake_cuda.memory_probe``):

- ``census``: every tensor each decoder layer saves for its backward (``torch.autograd.graph.
  saved_tensors_hooks`` around the forward), by layer and by the submodule that saved it, with the
  Megatron call site; parameters are left out and each storage is counted once.
- ``peak``: where the forward/backward peaks (MemTracker's module stack and the call sites at each new
  peak) and the live storages there, by size.

benchmarks/RESULTS.md ("Qwen3-30B-A3B: the all-to-all dispatcher's copies") quotes both. Both reach into
MemTracker's private bookkeeping (``_update_peak_stats``, ``_WINFO``): a torch upgrade may move them.

    python benchmarks/moe_memory_census.py CONFIG.yaml --stage 0 --view census --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # as the probe runs: fake tensors run eagerly

import torch  # noqa: E402
import yaml  # noqa: E402
from torch.optim.optimizer import register_optimizer_step_pre_hook  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launchers.measure import probe_config  # noqa: E402
from launchers.planner import plan_input_from_config  # noqa: E402
from megatron_arpo.config import build_config  # noqa: E402
from megatron_arpo.fake_cuda import memory_probe  # noqa: E402

logger = logging.getLogger("moe_memory_census")
MiB = 2**20


def _megatron_sites(depth: int = 8) -> list[str]:
    frames = [f for f in traceback.extract_stack()[:-2] if "megatron/" in f.filename and "fake_cuda" not in f.filename]
    return [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames[-depth:]]


def census(cfg, stage: int) -> dict:
    """Per layer: the storages its forward saves for backward (parameters left out, each storage once)."""
    stack: list[tuple[int | None, str]] = []
    saved: dict[int, dict] = collections.defaultdict(dict)   # layer -> storage id -> record
    params: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        layer = next((entry for entry in reversed(stack) if entry[0] is not None), None)
        storage = t.untyped_storage()
        if layer is not None and storage._cdata not in params:
            saved[layer[0]].setdefault(storage._cdata, {"module": layer[1], "shape": list(t.shape),
                                                        "dtype": str(t.dtype).removeprefix("torch."),
                                                        "bytes": storage.nbytes(), "site": _megatron_sites(1)})
        return t

    update = memory_probe.tracked_update

    def tracked(worker, batch, device):
        params.update(p.untyped_storage()._cdata for p in worker.model.parameters())
        hooks = []
        for name, module in worker.model.named_modules():
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1]) if "layers" in parts[:-1] else None
            sub = ".".join(parts[parts.index("layers") + 2:]) if layer is not None else name
            hooks.append(module.register_forward_pre_hook(lambda m, a, entry=(layer, sub): stack.append(entry)))
            hooks.append(module.register_forward_hook(lambda m, a, o: stack.pop() and None))  # None: keep the output
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return update(worker, batch, device)
        finally:
            for hook in hooks:
                hook.remove()

    memory_probe.tracked_update = tracked
    try:
        result = memory_probe.measure_stage(cfg, stage)
    finally:
        memory_probe.tracked_update = update
    layers = {layer: sorted(records.values(), key=lambda r: -r["bytes"]) for layer, records in sorted(saved.items())}
    for layer, records in layers.items():
        logger.info("layer %d saves %.1f MiB in %d storages", layer, sum(r["bytes"] for r in records) / MiB,
                    len(records))
    return {"kept_per_micro_batch": result["kept_per_micro_batch"], "layers": layers}


def peak(cfg, stage: int) -> dict:
    """The forward/backward's last new peak: its module stack, call sites and live storages by size."""
    last: dict = {}  # the latest new peak's record
    stepping = {"on": False}
    make_tracker = memory_probe._tracker

    def tracker():
        t = make_tracker()
        update_peak = type(t)._update_peak_stats

        def update(self, peak_state):
            before = dict(self._peak_mem)
            update_peak(self, peak_state)
            for dev, value in self._peak_mem.items():
                if value > before.get(dev, 0) and not stepping["on"]:
                    live = collections.Counter((str(info.reftype), int(info.mem_consumed))
                                               for info, _ in list(self._WINFO.values()))
                    last.update(bytes=int(value), backward=bool(self._mod_tracker.is_bw),
                                modules=sorted(self._mod_tracker.parents)[-6:], sites=_megatron_sites(),
                                live=sorted(([k, n, c] for (k, n), c in live.items()), key=lambda r: -r[1])[:20])
        t._update_peak_stats = update.__get__(t)
        return t

    memory_probe._tracker = tracker
    hook = register_optimizer_step_pre_hook(lambda *a: stepping.update(on=True))
    try:
        memory_probe.measure_stage(cfg, stage)
    finally:
        memory_probe._tracker = make_tracker
        hook.remove()
    logger.info("forward/backward peak %.2f GiB (%s) in %s", last["bytes"] / 2**30,
                "backward" if last["backward"] else "forward", last["sites"][-1] if last["sites"] else "?")
    return last


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--view", choices=["census", "peak"], default="census")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    raw = yaml.safe_load(args.config.read_text())
    cfg = build_config(probe_config(raw, plan_input_from_config(raw)))
    out = census(cfg, args.stage) if args.view == "census" else peak(cfg, args.stage)
    args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
