"""``megatron-arpo plan --measure``: the actor's memory measured, not estimated, next to the formula.

For each pipeline stage asked for (by default the one the formula says is the worst), a fresh process
runs ``python -m megatron_arpo.fake_cuda.memory_probe``: that stage of the experiment's layout, built as the
actor builds it, runs one PPO optimizer step over a full micro-batch on fake CUDA devices at real shapes,
under torch's MemTracker (see that module for what is measured and how it differs from a GPU run). A
process per stage: the fake-CUDA harness changes process-wide torch state, and the planner's process
stays free of Megatron.

The measured peak then replaces the formula's actor peak in the fit decisions (colocated placement
included); the report shows both, category by category, with their ratio.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

from launchers.planner import GiB, Plan, PlanInput, actor_memory, colocated_peak, ipc_buffer_gib

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries")
PHASE_NAMES = {"forward_backward": "forward/backward", "optimizer_step": "optimizer step"}
PROBE_TIMEOUT_S = 1800


def probe_config(raw: Mapping[str, Any] | None, p: PlanInput, model: str | None = None) -> dict:
    """The experiment config the probe builds the actor from: the user's, with the plan's layout applied."""
    cfg = copy.deepcopy(dict(raw or {}))
    cfg.setdefault("model", {})
    if model or not cfg["model"].get("config"):
        cfg["model"]["config"] = model or p.model.name
    cfg["model"]["hf_checkpoint"] = None  # fake tensors: nothing is loaded
    actor = cfg.setdefault("actor", {})
    actor.update(tensor_parallel=p.tp, pipeline_parallel=p.pp, data_parallel=p.dp,
                 micro_batch_tokens=p.micro_batch_tokens, recompute=p.recompute,
                 sequence_parallel=p.sequence_parallel, use_distributed_optimizer=p.distributed_optimizer)
    actor.setdefault("use_te", "auto" if p.layer_spec == "te" else "false")
    cfg.setdefault("launcher", {}).update(nodes=p.nodes, gpus_per_node=p.gpus_per_node)
    if not raw:  # --model alone: the smallest valid experiment around it
        cfg.setdefault("tools", {"search": {"enabled": False}})
        prompt = min(1024, max(1, (p.seq_len or p.micro_batch_tokens) // 4))
        cfg.setdefault("data", {"max_prompt_tokens": prompt})
        cfg.setdefault("rollout", {"response_length": (p.seq_len or p.micro_batch_tokens) - prompt})
        cfg.setdefault("trainer", {"train_batch_size": 16})
    return cfg


def run_probe(cfg: Mapping[str, Any], stage: int, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """One stage measured in a fresh process; raises with the child's output when it fails."""
    with tempfile.TemporaryDirectory(prefix="plan-measure-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text(json.dumps({"config": cfg, "stage": stage}))
        proc = subprocess.run([sys.executable, "-m", "megatron_arpo.fake_cuda.memory_probe", str(spec)],
                              capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MEASURED ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RuntimeError(f"measuring pipeline stage {stage} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1][len("MEASURED "):])
    if "unavailable" in result:
        raise RuntimeError(f"plan --measure needs the fake CUDA harness: {result['unavailable']}")
    return result


def measure(raw: Mapping[str, Any] | None, p: PlanInput, plan: Plan, stages: str = "worst",
            model: str | None = None) -> dict:
    """Measure ``stages`` ("worst" = the formula's worst stage, "all", or a stage number)."""
    if stages == "worst":
        wanted = [plan.worst_stage]
    elif stages == "all":
        wanted = list(range(p.pp))
    else:
        wanted = [int(stages)]
        if not 0 <= wanted[0] < p.pp:
            raise ValueError(f"--stages {stages}: the layout has pipeline stages 0..{p.pp - 1}")
    cfg = probe_config(raw, p, model)
    results = [run_probe(cfg, stage) for stage in wanted]
    worst = max(results, key=lambda r: r["peak_bytes"])
    actor_gib = worst["peak_bytes"] / GiB
    rollout = plan.rollout_gib
    actor_bytes = {"total": worst["peak_bytes"], "params": worst["breakdown_bytes"]["params"]}
    colocated = colocated_peak(p, actor_bytes, rollout)
    fits_actor = actor_gib <= plan.budget_gib
    fits = plan.fits_rollout and (colocated <= plan.budget_gib if p.placement == "colocated" else fits_actor)
    formula, _ = actor_memory(p, plan.dp)
    for r in results:
        f = formula[r["stage"]]
        r["formula_gib"] = {k: f[k] / GiB for k in (*CATEGORIES, "total")}
        r["formula_phase"] = f["phase"]
        r["formula_phases_gib"] = {name: {k: v / GiB for k, v in lines.items()} for name, lines in f["phases"].items()}
    return {"stages": results, "worst_stage": worst["stage"], "actor_peak_gib": actor_gib,
            "colocated_peak_gib": colocated, "ipc_buffer_gib": ipc_buffer_gib(p), "fits_actor": fits_actor,
            "fits": fits}


def format_measured(measured: dict) -> str:
    ok = {True: "fits", False: "DOES NOT FIT"}
    lines = ["measured (fake CUDA at real shapes, MemTracker; GiB per rank; formula in brackets, measured/formula):"]
    for r in measured["stages"]:
        formula = r["formula_gib"]
        parts = [f"{k} {r['breakdown_bytes'][k] / GiB:.2f} [{formula[k]:.2f}]" for k in CATEGORIES]
        total = r["peak_bytes"] / GiB
        ratio = f" [{formula['total']:.2f}, x{total / formula['total']:.3f}]"
        lines.append(f"  pp{r['stage']} (rank {r['rank']}, {r['num_params']:,} params, {r['layer_spec']} spec, "
                     f"{r['seq_len']}-token sequences, {r['in_flight']} micro-batch(es) in flight): "
                     + ", ".join(parts) + f" = {total:.2f}{ratio}")
        other = [name for name, got in r["phases_bytes"].items() if got and name != r["phase"]]
        for name in other:  # the other phase, as the dense comparison reads it: activations + temporaries
            got, f = r["phases_bytes"][name], r["formula_phases_gib"][name]
            acts = (got["activations"] + got["temporaries"]) / GiB
            lines.append(f"    {PHASE_NAMES[name]}: activations + temporaries {acts:.2f} "
                         f"[{f['activations'] + f['temporaries']:.2f}], total {sum(got.values()) / GiB:.2f} "
                         f"[{f['total']:.2f}]")
        lines.append(f"    peak at the {PHASE_NAMES[r['phase']]} (formula: {PHASE_NAMES[r['formula_phase']]}); "
                     f"built in {r['build_s']} s, measured in {r['run_s']} s")
    lines.append(f"measured actor peak {measured['actor_peak_gib']:.1f} GiB (pp{measured['worst_stage']}) -> "
                 f"{ok[measured['fits_actor']]}; colocated {measured['colocated_peak_gib']:.1f} GiB -> "
                 f"{ok[measured['fits']]}")
    return "\n".join(lines)


def as_dict(measured: dict) -> dict:
    return json.loads(json.dumps(measured, default=lambda o: dataclasses.asdict(o)))
