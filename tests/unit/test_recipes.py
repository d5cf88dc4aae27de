"""The shipped 32B recipes: they load and validate, the planner says they fit on H100-80G in every phase,
docs/launching.md shows their current `--dry-run` scripts and docs/memory.md their planner output; the
off-policy variants differ from their sync recipe only in the pools and the mode, and docs/off_policy.md
shows their plan.

`python tests/unit/test_recipes.py` prints the generated blocks of both pages (run it from the repository root
and paste them when a recipe, the renderer or the planner changes)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from pathlib import Path

import pytest
import yaml

from launchers.cli import main as launchers_main, plan_main
from launchers.planner import plan_from_config
from megatron_arpo.cluster.placement import plan_placement
from megatron_arpo.config import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {
    "configs/qwq-32b-arpo-deepsearch.yaml": {"model": "qwq-32b", "tools": {"search", "python"}, "call_limit": 6},
    "configs/qwen3-32b-arpo-reasoning.yaml": {"model": "qwen3-32b", "tools": {"search", "python"}, "call_limit": 3},
}
# The off-policy variant of each RL recipe (separate GPU pools): what may differ from it, and nothing else.
OFFPOLICY_RECIPES = {"configs/qwq-32b-arpo-deepsearch-offpolicy.yaml": "configs/qwq-32b-arpo-deepsearch.yaml",
                     "configs/qwen3-32b-arpo-reasoning-offpolicy.yaml": "configs/qwen3-32b-arpo-reasoning.yaml"}
OFFPOLICY_CHANGES = {"name", "rollout.num_engines", "rollout.gpu_memory_utilization", "rollout.max_num_seqs",
                     "rollout.sync_transport", "trainer.placement", "trainer.mode", "trainer.actor_devices",
                     "trainer.rollout_devices", "trainer.run_dir", "logging.wandb.tags", "launcher.job_name"}
# The cold-start SFT recipe of each RL recipe: same model and actor layout; its HF export is the RL checkpoint.
SFT_RECIPES = {"configs/qwq-32b-sft.yaml": "configs/qwq-32b-arpo-deepsearch.yaml",
               "configs/qwen3-32b-sft.yaml": "configs/qwen3-32b-arpo-reasoning.yaml"}
# The MoE recipe and the dense recipe whose run it repeats: what may differ (model, layout, pools), nothing else.
MOE_RECIPES = {"configs/qwen3-30b-a3b-arpo.yaml": "configs/qwen3-32b-arpo-reasoning.yaml"}
MOE_CHANGES = {"name", "model.config", "model.hf_checkpoint", "actor.tensor_parallel", "actor.pipeline_parallel",
               "actor.expert_parallel", "actor.expert_tensor_parallel", "actor.use_te", "rollout.num_engines",
               "rollout.gpu_memory_utilization", "trainer.run_dir", "logging.wandb.tags", "launcher.nodes",
               "launcher.job_name"}
GPUS = ("h100-80g", "h200-141g", "a100-80g")
SLURM_ARGS = ("--partition", "P", "--account", "A", "--time", "48:00:00")


@contextlib.contextmanager
def _in_repo_root():
    cwd = os.getcwd()
    os.chdir(ROOT)  # recipes use paths relative to the repository root, as the docs' commands do
    try:
        yield
    finally:
        os.chdir(cwd)


def _stdout_of(fn, argv) -> tuple[int, str]:
    buf = io.StringIO()
    with _in_repo_root(), contextlib.redirect_stdout(buf):
        code = fn(argv)
    return code, buf.getvalue()


def dry_run_output(recipe: str) -> str:
    code, out = _stdout_of(launchers_main, ["slurm", "--config", recipe, *SLURM_ARGS, "--dry-run"])
    assert code == 0
    return out


def plan_output(recipe: str, gpu: str = "h100-80g") -> tuple[int, str]:
    return _stdout_of(plan_main, ["--config", recipe, "--gpu", gpu])


def reference_table() -> str:
    """Planner results for the recipes' layouts on every GPU type (markdown)."""
    rows = ["| recipe | model | GPU | actor TP x PP x DP, recompute | actor GiB (worst stage) | rollout need / vLLM "
            "reservation GiB (engine TP, seqs x len) | budget GiB | colocated GiB | verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    for recipe in RECIPES:
        raw = yaml.safe_load((ROOT / recipe).read_text())
        for gpu in GPUS:
            p = plan_from_config(raw, gpu=gpu)
            i = p.inputs
            rows.append(
                f"| `{recipe}` | {i['model']} | {gpu} | {i['tp']} x {i['pp']} x {p.dp}, {i['recompute']} "
                f"| {p.actor_peak_gib:.1f} (pp{p.worst_stage}) | {p.rollout_peak_gib:.1f} / {p.rollout_reserved_gib:.1f} "
                f"(TP {i['engine_tp']}, {i['concurrency']} x {i['max_model_len']}) | {p.budget_gib:.1f} "
                f"| {p.colocated_peak_gib:.1f} | {'fits' if p.fits else 'DOES NOT FIT'} |")
    return "\n".join(rows) + "\n"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_loads_and_validates(recipe):
    cfg = load_config(ROOT / recipe)
    want = RECIPES[recipe]
    assert cfg.model.config == want["model"]
    assert (cfg.launcher.nodes, cfg.launcher.gpus_per_node) == (4, 8)
    assert cfg.actor.params_dtype == "bf16" and cfg.actor.use_te == "auto"
    assert set(cfg.tools.enabled_tags) == want["tools"] and cfg.rollout.call_limit == want["call_limit"]
    assert (cfg.rollout.n, cfg.rollout.initial_rollouts, cfg.rollout.beam_size) == (16, 8, 2)
    assert cfg.tools.search.backend == "http" and cfg.tools.search.url.startswith("http://")
    # every data file is a placeholder under data/ (no absolute paths in committed configs)
    assert all(f.startswith("data/") for f in cfg.data.train_files + cfg.data.val_files)


@pytest.mark.parametrize("sft_recipe", sorted(SFT_RECIPES))
def test_sft_recipe_validates_and_hands_its_export_to_the_rl_recipe(sft_recipe, capsys):
    from megatron_arpo import cli
    from megatron_arpo.sft import sft_output_dir

    with _in_repo_root():
        assert cli.main(["config", "validate", "--config", sft_recipe]) == 0, capsys.readouterr().err
    sft, rl = load_config(ROOT / sft_recipe), load_config(ROOT / SFT_RECIPES[sft_recipe])
    assert sft.model.config == rl.model.config
    layout = lambda c: (c.launcher.nodes, c.launcher.gpus_per_node, c.actor.tensor_parallel, c.actor.pipeline_parallel,
                        c.actor.sequence_parallel, c.actor.params_dtype)
    assert layout(sft) == layout(rl) == (4, 8, 8, 2, True, "bf16")
    assert sft.sft.export_hf and str(sft_output_dir(sft) / "hf") == rl.model.hf_checkpoint
    assert sft.actor.micro_batch_tokens >= sft.sft.max_seq_tokens  # a full conversation fits a micro-batch
    # ARPO's cold-start stage (docs/design/arpo_reference.md §3.3)
    assert (sft.sft.lr, sft.sft.lr_schedule, sft.sft.warmup_fraction, sft.sft.epochs, sft.sft.global_batch_size,
            sft.sft.max_seq_tokens) == (7e-6, "cosine", 0.1, 3, 16, 15000)
    assert all(f.startswith("data/") for f in sft.sft.train_files)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_planner_says_recipe_fits_on_h100_in_every_phase(recipe):
    raw = yaml.safe_load((ROOT / recipe).read_text())
    plan = plan_from_config(raw, gpu="h100-80g")
    assert plan.fits_actor and plan.fits_rollout and plan.fits, plan.to_dict()
    assert plan.world == 32
    code, out = plan_output(recipe)
    assert code == 0 and "DOES NOT FIT" not in out.split("layouts that fit")[0], out


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize("recipe", sorted(OFFPOLICY_RECIPES))
def test_offpolicy_recipe_is_its_sync_recipe_on_separate_pools(recipe):
    cfg, sync = load_config(ROOT / recipe), load_config(ROOT / OFFPOLICY_RECIPES[recipe])
    assert (cfg.trainer.mode, cfg.trainer.placement, cfg.rollout.max_staleness) == ("off_policy", "separate", 1)
    assert cfg.trainer.actor_devices + cfg.trainer.rollout_devices == 32 and cfg.rollout.sync_transport == "nccl"
    assert cfg.rollout.buffer_groups == 2 * cfg.trainer.train_batch_size  # null in the file: (K + 1) x batch
    new, old = _flat(dataclasses.asdict(cfg)), _flat(dataclasses.asdict(sync))
    new.pop("rollout.buffer_groups"), old.pop("rollout.buffer_groups")  # resolved from the batch (and K)
    changed = {k for k in new.keys() | old.keys() if new.get(k) != old.get(k)}
    assert changed <= OFFPOLICY_CHANGES, sorted(changed - OFFPOLICY_CHANGES)
    # as many sequences in flight as the colocated recipe, on half the engines
    assert cfg.rollout.num_engines * cfg.rollout.max_num_seqs == sync.rollout.num_engines * sync.rollout.max_num_seqs
    assert "--job-name=" + cfg.launcher.job_name in dry_run_output(recipe)
    # the Ray pools: one actor replica (DP 1) and 4 engines of 4 GPUs, each TP group within a node of 8
    placement = plan_placement(cfg)
    assert {name: pool.size for name, pool in placement.pools.items()} == {"actor": 16, "rollout": 16}
    assert cfg.layout.world_size == 16 and placement.engine_bundles[-1] == (12, 13, 14, 15)


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("recipe", sorted(OFFPOLICY_RECIPES))
def test_planner_says_offpolicy_recipe_fits_and_counts_both_pools_and_the_buffer(recipe, gpu):
    cfg = load_config(ROOT / recipe)
    plan = plan_from_config(yaml.safe_load((ROOT / recipe).read_text()), gpu=gpu)
    assert plan.fits_actor and plan.fits_rollout and plan.fits_sync and plan.fits, plan.to_dict()
    assert (plan.world, plan.actor_gpus, plan.engine_gpus, plan.dp, plan.num_engines) == (
        32, cfg.trainer.actor_devices, cfg.trainer.rollout_devices, 1, cfg.rollout.num_engines)
    per_trajectory = 40 * cfg.data.max_prompt_tokens + 96 * cfg.rollout.response_length
    assert plan.buffer_gib["buffer"] == pytest.approx(
        cfg.rollout.buffer_groups * cfg.rollout.n * per_trajectory / 2**30)
    code, out = plan_output(recipe, gpu)
    assert code == 0 and "DOES NOT FIT" not in out.split("layouts that fit")[0], out
    assert "GPU pools (separate)" in out and "rollout buffer (off_policy" in out


@pytest.mark.parametrize("recipe", sorted(MOE_RECIPES))
def test_moe_recipe_is_the_dense_run_on_an_expert_parallel_layout(recipe):
    cfg, dense = load_config(ROOT / recipe), load_config(ROOT / MOE_RECIPES[recipe])
    assert cfg.model.config == "qwen3-30b-a3b" and (cfg.launcher.nodes, cfg.launcher.gpus_per_node) == (2, 8)
    assert (cfg.actor.tensor_parallel, cfg.actor.pipeline_parallel, cfg.actor.expert_parallel) == (4, 2, 2)
    # the weight sync and the HF export stream from EP > 1 only with the experts split as the dense layers
    assert cfg.actor.expert_tensor_parallel in (None, cfg.actor.tensor_parallel)
    new, old = _flat(dataclasses.asdict(cfg)), _flat(dataclasses.asdict(dense))
    changed = {k for k in new.keys() | old.keys() if new.get(k) != old.get(k)}
    assert changed <= MOE_CHANGES, sorted(changed - MOE_CHANGES)
    assert "--nodes=2" in dry_run_output(recipe)
    placement = plan_placement(cfg)
    assert placement.engine_bundles[-1] == (12, 13, 14, 15)  # 4 engines of TP 4, each within a node of 8


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("recipe", sorted(MOE_RECIPES))
def test_planner_says_moe_recipe_fits_in_every_phase(recipe, gpu):
    plan = plan_from_config(yaml.safe_load((ROOT / recipe).read_text()), gpu=gpu)
    assert plan.fits_actor and plan.fits_rollout and plan.fits_sync and plan.fits, plan.to_dict()
    assert (plan.world, plan.dp) == (16, 2) and plan.active_params < plan.total_params / 9
    code, out = plan_output(recipe, gpu)
    assert code == 0 and "DOES NOT FIT" not in out.split("layouts that fit")[0], out
    assert "EP=2 expert TP=4" in out


@pytest.mark.parametrize(("page", "recipes"), [("off_policy.md", OFFPOLICY_RECIPES), ("moe.md", MOE_RECIPES)])
def test_doc_pages_show_their_recipes_current_plan(page, recipes):
    doc = (ROOT / "docs" / page).read_text()
    for recipe in recipes:
        assert f"megatron-arpo plan --config {recipe} --gpu h100-80g" in doc
        stale = f"docs/{page} is stale: run `python tests/unit/test_recipes.py` and paste its blocks"
        assert plan_output(recipe)[1] in doc, f"{stale} ({recipe} plan)"


def test_docs_show_current_dry_run_and_planner_output():
    launching = (ROOT / "docs" / "launching.md").read_text()
    memory = (ROOT / "docs" / "memory.md").read_text()
    stale = "is stale: run `python tests/unit/test_recipes.py` and paste its blocks"
    for recipe in RECIPES:
        script = dry_run_output(recipe)
        assert "/work/" not in script and str(ROOT) not in script  # nothing of this machine leaks
        assert script in launching, f"docs/launching.md {stale} ({recipe} --dry-run)"
        assert f"megatron-arpo launch slurm --config {recipe} --partition P --account A --time 48:00:00" in launching
        assert plan_output(recipe)[1] in memory, f"docs/memory.md {stale} ({recipe} plan)"
    assert reference_table() in memory, f"docs/memory.md {stale} (reference table)"


if __name__ == "__main__":
    for recipe in RECIPES:
        print(f"===== megatron-arpo launch slurm --config {recipe} {' '.join(SLURM_ARGS)} --dry-run")
        print(dry_run_output(recipe), end="")
    for recipe in RECIPES:
        print(f"===== megatron-arpo plan --config {recipe} --gpu h100-80g")
        print(plan_output(recipe)[1], end="")
    for recipe in OFFPOLICY_RECIPES:  # docs/off_policy.md
        print(f"===== megatron-arpo plan --config {recipe} --gpu h100-80g")
        print(plan_output(recipe)[1], end="")
    for recipe in MOE_RECIPES:  # docs/moe.md
        print(f"===== megatron-arpo plan --config {recipe} --gpu h100-80g")
        print(plan_output(recipe)[1], end="")
    print("===== reference table")
    print(reference_table(), end="")
