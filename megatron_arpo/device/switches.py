"""The inventory of every place the code behaves differently on CPU and on GPU, with the reason.

The CPU tests should run what a GPU job runs; each entry here is a difference a library forces (or a
resource fact), named with the test that runs its GPU side where this machine allows one.
tests/unit/test_device_switches.py scans megatron_arpo/, conversion/, launchers/ and evaluation/ for
device branches and fails on a function with a branch that no entry lists, or an entry whose function
is gone. docs/cpu_gpu_switches.md shows the table (``python -m megatron_arpo.device.switches`` rewrites it).

To add a switch: append a `Switch` to `SWITCHES`, then regenerate the page.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["SWITCHES", "Switch", "render_table", "write_doc"]


@dataclass(frozen=True)
class Switch:
    id: str
    where: tuple[str, ...]   # "path/from/repo/root.py:Qualified.function" ("<module>" for module level)
    cpu: str                 # what happens on a CPU machine
    gpu: str                 # what happens on a GPU machine
    reason: str              # which library (or resource fact) forces the difference
    gpu_test: str            # the test that runs the GPU side, or why none can run here


SWITCHES: tuple[Switch, ...] = (
    Switch(
        id="vllm-cpu-packed-tied-head",
        where=("megatron_arpo/weight_sync/receivers.py:repack_tied_heads",),
        cpu="after each weight sync the tied LM head's packed GEMM copy is rebuilt from the embedding it shares",
        gpu="nothing to rebuild: the head reads the shared parameter the sync wrote in place",
        reason="vLLM 0.32's CPU GEMM (oneDNN / sgl kernels) packs each weight into a kernel-owned copy after "
               "loading, and its layerwise reload re-processes only the layer that loaded a tied parameter",
        gpu_test="tests/integration/test_rollout_vllm.py::test_a_synced_tied_embedding_reaches_the_lm_head runs "
                 "the CPU side; on GPU the function finds no module with a packed copy and does nothing",
    ),
    Switch(
        id="vllm-cpu-packed-experts",
        where=("megatron_arpo/weight_sync/receivers.py:rearm_packed_experts",),
        cpu="before each weight sync the MoE layers drop their expert kernel, so the reload packs the new experts "
            "into the CPU kernel's grouped-GEMM layout as a first load does",
        gpu="nothing dropped: vLLM's GPU experts read the parameters the sync wrote in place",
        reason="vLLM 0.32's unquantized MoE method runs its experts' weight packing on the first load only; "
               "vllm-cpu's experts pack there, so a weight update left the CPU kernel computing with stale experts",
        gpu_test="tests/integration/test_moe_engine.py::test_a_sync_of_every_expert_reaches_the_cpu_moe_kernel "
                 "runs the CPU side; tests/unit/test_rearm_packed_experts.py runs the dispatch on vLLM's GPU "
                 "(Triton) experts class, which keeps its kernel",
    ),
    Switch(
        id="vllm-executor",
        where=("megatron_arpo/rollout/engine.py:executor_backend",),
        cpu="an engine with tensor_parallel_size > 1 runs its workers under vLLM's mp executor",
        gpu="under vLLM's ray executor, one worker per placement-group bundle of the engine",
        reason="vLLM 0.32's CPU platform refuses the ray executor",
        gpu_test="tests/unit/test_placement.py::test_engine_actor_options_follow_the_plan builds the GPU options; "
                 "the ray executor itself needs GPUs (none here)",
    ),
    Switch(
        id="vllm-batch-invariant",
        where=("megatron_arpo/rollout/engine.py:batch_invariant_env",),
        cpu="trainer.deterministic leaves the engines as they are (their numbers do not depend on the batch)",
        gpu="trainer.deterministic sets VLLM_BATCH_INVARIANT=1 in every engine's environment",
        reason="vLLM 0.32's batch-invariant ops are Triton kernels; its CPU build fails the first forward with "
               "them ('function' object is not subscriptable in mean_kernel[grid])",
        gpu_test="tests/unit/test_determinism.py::test_gpu_engines_get_the_batch_invariant_mode_only_with_the_flag "
                 "builds the GPU environment; the kernels themselves need a GPU",
    ),
    Switch(
        id="vllm-cuda-kwargs",
        where=("megatron_arpo/rollout/engine.py:VllmEngine.__init__", "megatron_arpo/rollout/engine.py:_cuda_available"),
        cpu="gpu_memory_utilization and enable_sleep_mode are not passed; sleep/wake_up pause the scheduler and "
            "free nothing",
        gpu="both passed from the rollout section",
        reason="vLLM's CPU worker reads gpu_memory_utilization as a share of host RAM that must be free (its KV "
               "cache comes from VLLM_CPU_KVCACHE_SPACE); its CPU platform refuses enable_sleep_mode",
        gpu_test="none: only a CUDA build of vLLM accepts sleep mode; tests/integration/test_trainer_phases.py runs "
                 "the sleep/offload/wake/sync order with the CPU no-op sleep",
    ),
    Switch(
        id="engine-actor-resources",
        where=("megatron_arpo/rollout/engine_actor.py:engine_actor_options",
               "megatron_arpo/rollout/engine_actor.py:engine_ray_options"),
        cpu="the engine actor takes no GPU; no VLLM_RAY_* variables",
        gpu="the actor takes its GPU share (one worker) or none with VLLM_RAY_BUNDLE_INDICES and "
            "VLLM_RAY_PER_WORKER_GPUS for vLLM's ray workers (tensor parallel)",
        reason="Ray schedules GPUs only on nodes that have them; vLLM's ray executor reads the two variables",
        gpu_test="tests/unit/test_placement.py::test_engine_actor_options_follow_the_plan",
    ),
    Switch(
        id="ipc-insecure-serialisation",
        where=("megatron_arpo/rollout/engine.py:engine_env",),
        cpu="never set (gloo payloads are plain data); VLLM_CPU_* variables set (vLLM's GPU platform ignores them)",
        gpu="VLLM_ALLOW_INSECURE_SERIALIZATION=1 for the ipc transport only",
        reason="vLLM msgpack-encodes update_weights into its engine-core subprocess and refuses the CUDA-IPC "
               "handles (reduce_tensor tuples with a function, classes and a dtype) without the flag",
        gpu_test="tests/unit/test_engine_serialisation.py::test_only_ipc_payloads_turn_insecure_serialisation_on",
    ),
    Switch(
        id="weight-transport",
        where=("megatron_arpo/weight_sync/protocol.py:choose_transport",),
        cpu="gloo (our receiver over vLLM's stateless process group)",
        gpu="ipc when colocated, nccl for separate pools (vLLM's engines)",
        reason="NCCL and CUDA IPC need CUDA devices",
        gpu_test="tests/unit/test_rollout_weight_sync.py::test_transport_follows_the_placement (the choice); the "
                 "nccl and ipc receivers need GPUs (none here)",
    ),
    Switch(
        id="actor-process-group",
        where=("megatron_arpo/actor/worker.py:MegatronActorWorker.__init__",),
        cpu="torch.distributed on gloo",
        gpu="on nccl, after torch.cuda.set_device(LOCAL_RANK)",
        reason="NCCL needs CUDA devices",
        gpu_test="tests/fakecuda/test_actor_gpu_paths.py (the actor's GPU branches on fake CUDA tensors)",
    ),
    Switch(
        id="collective-device",
        where=("megatron_arpo/actor/training.py:collective_device", "megatron_arpo/actor/hf_live.py:_broadcast_bucket"),
        cpu="tensors for collectives live on the host",
        gpu="on the current GPU",
        reason="NCCL takes CUDA tensors only, gloo host tensors",
        gpu_test="tests/fakecuda/test_actor_gpu_paths.py::test_no_cpu_tensor_reaches_an_nccl_collective",
    ),
    Switch(
        id="model-placement",
        where=("megatron_arpo/actor/model_builder.py:place_model", "megatron_arpo/actor/logprobs.py:run_model"),
        cpu="the model and its batches stay on the host",
        gpu="the stage moves to the current GPU, batches are copied there",
        reason="torch: no CUDA device on a CPU machine",
        gpu_test="tests/fakecuda/test_actor_gpu_paths.py::test_stage_lives_on_its_gpu_in_bf16_under_float16module",
    ),
    Switch(
        id="transformer-engine",
        where=("megatron_arpo/actor/model_builder.py:resolve_use_te",),
        cpu="actor.use_te: auto means the local layer spec",
        gpu="Transformer Engine's spec when importable, else the local spec (refused for long micro-batches)",
        reason="Transformer Engine needs CUDA",
        gpu_test="tests/fakecuda/test_actor_gpu_paths.py runs the GPU branch; transformer_engine is not installed "
                 "here, so it takes the local-spec fallback",
    ),
    Switch(
        id="moe-token-dispatcher",
        where=("megatron_arpo/actor/model_builder.py:build_transformer_config",),
        cpu="MoE tokens reach their experts through Megatron's all-gather dispatcher",
        gpu="the all-to-all dispatcher",
        reason="Megatron's all-to-all dispatcher creates a CUDA stream for its device-to-host copies",
        gpu_test="tests/fakecuda/test_actor_ep_paths.py runs the all-to-all one on fake CUDA at EP 2 (TP 1 and 2); "
                 "tests/dist/test_moe_parallel.py runs the all-gather one at EP 2",
    ),
    Switch(
        id="cuda-rng",
        where=("megatron_arpo/actor/checkpoint.py:rng_state", "megatron_arpo/actor/checkpoint.py:set_rng_state"),
        cpu="checkpoints hold the host RNG states only",
        gpu="plus the CUDA RNG state",
        reason="torch: the CUDA generator exists only with CUDA",
        gpu_test="tests/fakecuda/test_actor_gpu_paths.py::test_log_probs_update_sft_and_checkpoint_ran",
    ),
    Switch(
        id="megatron-cpu-compat",
        where=("megatron_arpo/device/cpu_compat.py:apply_cpu_compat",
               "megatron_arpo/device/cpu_compat.py:_is_cuda_device"),
        cpu="megatron-core's CUDA-only calls are patched to run on the host",
        gpu="nothing is patched",
        reason="megatron-core 0.16 assumes CUDA (streams, device placement, fused kernels)",
        gpu_test="tests/fakecuda/test_harness.py::test_refuses_to_share_a_process_with_the_cpu_compat_layer "
                 "(the layer stays off under CUDA)",
    ),
    Switch(
        id="offload-pinned",
        where=("megatron_arpo/actor/offload.py:StateOffloader.__init__",
               "megatron_arpo/actor/offload.py:StateOffloader._synchronize",
               "megatron_arpo/actor/offload.py:StateOffloader.offload"),
        cpu="the offloaded state goes to plain host buffers; no stream sync, no cache release",
        gpu="to pinned host buffers, with torch.cuda.synchronize and empty_cache around the copies",
        reason="torch: pinned memory, CUDA streams and the caching allocator exist only with CUDA",
        gpu_test="none: tests/dist/test_actor_offload.py runs the offload with the host as the device",
    ),
    Switch(
        id="ray-resources",
        where=("megatron_arpo/cluster/placement.py:<module>", "megatron_arpo/cluster/placement.py:_bundle",
               "megatron_arpo/cluster/placement.py:plan_placement", "megatron_arpo/cluster/placement.py:PlacementPlan.describe",
               "megatron_arpo/actor/group.py:ActorGroup.__init__"),
        cpu="bundles hold CPUs only; colocated CPU pools are process slots",
        gpu="one bundle per GPU, actor ranks and engines take GPU shares",
        reason="Ray schedules GPUs only on nodes that have them",
        gpu_test="tests/unit/test_placement.py::test_colocated_gpu_one_bundle_per_gpu_with_time_slicing and "
                 "::test_separate_gpu_pools_are_disjoint_and_sized_from_the_config (plans); no GPU node here",
    ),
    Switch(
        id="cpu-block-size",
        where=("megatron_arpo/trainer/runtime.py:start_runtime", "megatron_arpo/trainer/runtime.py:_start_engines"),
        cpu="engines get block_size 32",
        gpu="vLLM's default block size",
        reason="vLLM's CPU platform defaults to 128-token KV blocks and its CPU attention wants multiples of 32; 32 "
               "keeps prefix caching at a granularity close to the GPU default",
        gpu_test="none: the GPU side is vLLM's default, which only a GPU engine runs",
    ),
    Switch(
        id="sft-cpus",
        where=("megatron_arpo/sft.py:_cpus_per_rank",),
        cpu="each SFT rank takes its share of the cluster's CPUs (and as many threads)",
        gpu="the actor group's default, one CPU per GPU rank",
        reason="Ray hands out CPUs as resources; on a CPU node they are the compute",
        gpu_test="none: the GPU side is the default every actor-group test uses with num_cpus_per_rank",
    ),
    Switch(
        id="doctor-gpu-checks",
        where=("megatron_arpo/doctor.py:check_torch",),
        cpu="the CUDA-build and visible-GPU checks fail, naming CUDA_VISIBLE_DEVICES and the fix",
        gpu="they pass and list the GPUs",
        reason="`megatron-arpo doctor` checks that a node can run the GPU job (a CUDA torch, GPUs allocated)",
        gpu_test="none: tests/unit/test_doctor.py::test_doctor_on_a_cpu_machine_says_exactly_what_is_missing "
                 "runs the CPU side",
    ),
    Switch(
        id="demo-cpu-env",
        where=("megatron_arpo/demo.py:Demo._env",),
        cpu="VLLM_CPU_KVCACHE_SPACE and VLLM_CPU_OMP_THREADS_BIND=nobind for every stage",
        gpu="the same (vLLM's GPU platform ignores them)",
        reason="the demo is a CPU demo; vLLM's CPU worker would otherwise claim most free RAM and pin threads",
        gpu_test="none needed: the variables are the same on both",
    ),
    Switch(
        id="cpu-chunked-prefill",
        where=("megatron_arpo/rollout/engine.py:prefill_settings",),
        cpu="no chunked prefill; the batch budget holds the longest context (max_num_batched_tokens >= max_model_len)",
        gpu="vLLM's chunked-prefill defaults",
        reason="vllm-cpu 0.32 fails the step ('CPU Generator does not use offset') when a seeded request's prefill "
               "is chunked: it rewinds the request's generator with set_offset, which only CUDA generators have",
        gpu_test="none: the GPU side is vLLM's default; tests/integration/test_rollout_engine_requests.py::"
                 "test_seeded_long_contexts_run_with_a_small_batch_budget_on_cpu runs the CPU side",
    ),
    Switch(
        id="kv-cache-size-source",
        where=("megatron_arpo/rollout/kv_cache.py:check_kv_caches",
               "megatron_arpo/trainer/runtime.py:start_rollout_engines",
               "megatron_arpo/trainer/runtime.py:ready_engines", "megatron_arpo/trainer/runtime.py:restart_engine"),
        cpu="the KV cache is VLLM_CPU_KVCACHE_SPACE (rollout.cpu_kv_cache_gib); a short one names that fix",
        gpu="gpu_memory_utilization's share of the device, or rollout.kv_cache_gib (kv_cache_memory_bytes); a short "
            "one names those fixes",
        reason="vLLM's CPU worker sizes its KV cache from VLLM_CPU_KVCACHE_SPACE and ignores the GPU settings",
        gpu_test="tests/integration/test_trainer_phases.py checks the measured size and the refusal on CPU; the GPU "
                 "figures need a GPU (none here)",
    ),
    Switch(
        id="node-contiguity-strictness",
        where=("megatron_arpo/cluster/placement.py:bind_slots",
               "megatron_arpo/actor/group.py:ActorGroup._check_tp_groups_on_one_node"),
        cpu="a TP group or an engine across nodes is a warning",
        gpu="refused at start-up with the bundles per node and the fix",
        reason="on GPU a split TP group sends its collectives over the network instead of NVLink; the CPU tests put "
               "gloo TP groups on both local raylets on purpose (no NVLink to lose)",
        gpu_test="tests/unit/test_node_placement_plan.py and tests/integration/test_node_placement.py (bind(strict=True): "
                 "the GPU refusal)",
    ),
    Switch(
        id="ray-keeps-cuda-visible-devices",
        where=("megatron_arpo/cluster/ray_compat.py:<module>",),
        cpu="RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0 in every engine actor's environment",
        gpu="the same (not a switch: listed because it names a RAY_ variable)",
        reason="Ray 2.50-2.55 blank CUDA_VISIBLE_DEVICES for num_gpus=0 actors unless told not to; the engine actor "
               "of a TP > 1 engine holds no GPU",
        gpu_test="tests/integration/test_node_placement.py (an engine-like actor keeps CUDA_VISIBLE_DEVICES)",
    ),
)


def render_table(switches: tuple[Switch, ...] = SWITCHES) -> str:
    """The markdown table of the docs page (one row per switch)."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| id | where | CPU | GPU | why | GPU side tested by |", "|---|---|---|---|---|---|"]
    for s in switches:
        where = "<br>".join(f"`{w}`" for w in s.where)
        rows.append(f"| `{s.id}` | {where} | {cell(s.cpu)} | {cell(s.gpu)} | {cell(s.reason)} | {cell(s.gpu_test)} |")
    return "\n".join(rows) + "\n"


BEGIN, END = "<!-- switches:begin (generated by python -m megatron_arpo.device.switches) -->", "<!-- switches:end -->"


def embedded_table(text: str) -> str:
    """The generated part of the docs page."""
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    if match is None:
        raise ValueError(f"the page has no {BEGIN!r} ... {END!r} block")
    return match.group(1)


def write_doc(path: Path) -> None:
    """Rewrite the generated block of the docs page in place."""
    text = path.read_text()
    old = embedded_table(text)
    path.write_text(text.replace(f"{BEGIN}\n{old}{END}", f"{BEGIN}\n{render_table()}{END}"))


if __name__ == "__main__":
    write_doc(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "docs" / "cpu_gpu_switches.md")
