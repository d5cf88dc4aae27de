"""The rollout engine as a Ray async actor: its resources, environment and ``.options()``, and the factory.

`create_engine_actor` starts a `megatron_arpo.rollout.engine.VllmEngine` in a Ray actor whose concurrent
method calls are coroutines on the actor's loop; `engine_actor_options` and `engine_ray_options` turn an
`EngineConfig` and its placement (megatron_arpo/cluster/placement.py) into the actor's resources, vLLM's
executor variables and the placement-group scheduling strategy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from megatron_arpo.cluster.ray_compat import ENGINE_RAY_ENV, check_ray_version
from megatron_arpo.rollout.engine import EngineConfig, VllmEngine, batch_invariant_env, engine_env, executor_backend


def engine_actor_options(cfg: EngineConfig, *, on_gpu: bool, num_cpus: float = 1, gpu_share: float = 1.0,
                         bundle_indices: Sequence[int] = ()) -> tuple[dict[str, Any], dict[str, str]]:
    """Ray resources and env vars of an engine actor: ``({"num_cpus", "num_gpus"}, env)``.

    GPU, one worker: the actor holds the worker, so it takes ``gpu_share`` of its bundle's GPU (a fraction
    when colocated with an actor rank). GPU, ``tensor_parallel_size`` > 1: vLLM's ``ray`` executor starts
    one worker per bundle of ``bundle_indices`` (``VLLM_RAY_BUNDLE_INDICES``) with ``gpu_share`` each
    (``VLLM_RAY_PER_WORKER_GPUS``), in the placement group the actor runs in; the actor itself takes no
    GPU. CPU: no GPUs; several workers run under the ``mp`` executor.
    """
    env = {**engine_env(cfg), **batch_invariant_env(cfg, on_gpu)}
    num_gpus = gpu_share if on_gpu else 0.0
    if executor_backend(cfg.tensor_parallel_size, on_gpu) == "ray":
        if len(bundle_indices) != cfg.tensor_parallel_size:
            raise ValueError(f"an engine with tensor_parallel_size {cfg.tensor_parallel_size} needs as many "
                             f"placement-group bundles, got {list(bundle_indices)}")
        env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(str(b) for b in bundle_indices)
        env["VLLM_RAY_PER_WORKER_GPUS"] = f"{gpu_share:g}"
        num_gpus = 0.0
    return {"num_cpus": num_cpus, "num_gpus": num_gpus}, env


def engine_ray_options(
    cfg: EngineConfig,
    *,
    num_cpus: float = 1,
    num_gpus: float = 0,
    placement_group: Any = None,
    bundle_index: int = -1,
    bundle_indices: Sequence[int] = (),
    env: Optional[dict[str, str]] = None,
    name: Optional[str] = None,
    max_concurrency: int = 1000,
) -> dict[str, Any]:
    """The Ray ``.options()`` of an engine actor (see `create_engine_actor`); refuses a Ray below the floor."""
    check_ray_version()
    resources, env_vars = engine_actor_options(cfg, on_gpu=num_gpus > 0, num_cpus=num_cpus, gpu_share=num_gpus,
                                               bundle_indices=bundle_indices or ([bundle_index] if bundle_index >= 0
                                                                                 else []))
    env_vars.update(env or {})
    # Set last, so neither ``env`` nor a cluster-wide setting brings the blanking back: with rollout TP > 1 on
    # GPU the engine actor holds no GPU, and a blanked CUDA_VISIBLE_DEVICES sends it down the CPU path
    # (megatron_arpo/cluster/ray_compat.py).
    env_vars.update(ENGINE_RAY_ENV)
    options: dict[str, Any] = dict(**resources, max_concurrency=max_concurrency, runtime_env={"env_vars": env_vars})
    if name is not None:
        options["name"] = name
    if placement_group is not None:
        # deferred: pulls in ray (heavy; this module imports without it)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=bundle_index,
            placement_group_capture_child_tasks=True,
        )
    return options


def create_engine_actor(cfg: EngineConfig, engine_index: int = 0, **options: Any) -> Any:
    """Start a `VllmEngine` as a Ray async actor; returns the actor handle.

    ``options`` are `engine_ray_options`'s: ``num_gpus`` is the GPU share of each of the engine's workers
    (0 on CPU), which `engine_actor_options` turns into the actor's resources and vLLM's executor settings;
    ``env`` adds to ``engine_env(cfg)`` (VLLM_CPU_KVCACHE_SPACE etc.) in the actor's runtime_env. With a
    ``placement_group`` the actor is pinned to ``bundle_index`` (the first of ``bundle_indices``;
    ``ResourcePools.engine_placement`` gives them in node order), and child tasks (vLLM's ``ray`` workers)
    stay in the group. ``max_concurrency`` bounds the number of concurrently running coroutines
    (= requests in flight) in the actor.
    """
    # deferred: pulls in ray (heavy; this module imports without it)
    import ray

    actor_cls = ray.remote(VllmEngine)
    return actor_cls.options(**engine_ray_options(cfg, **options)).remote(dataclasses.asdict(cfg), engine_index)
