"""Colocated phases: the one place that orders who holds each GPU's memory (issue 12, item 4).

With ``trainer.placement: colocated`` every GPU serves, in turn, the vLLM engines (rollout, validation)
and the actor ranks (log-probs, update, checkpoint). Two switches let each side release its memory
while the other works:

- ``rollout.enable_sleep_mode``: the engines sleep while the actor works (``rollout.sleep_level``: 1
  keeps their weights in host memory, 2 drops them, since the sync after every update re-sends them all);
- ``actor.offload``: the actor's grad buffers are freed and its optimizer state waits in host memory
  while the engines work (``megatron_arpo.actor.offload``); its weights stay, the sync reads them.

``switch_phase(rt, target)`` moves the runtime into a phase, in this order:

to ``"train"`` (after a rollout, before the log-probs):
  1. the engines sleep;
  2. the actor onloads its optimizer state and grad buffers.
to ``"rollout"`` (after the update, before the validation and the checkpoint; once at start-up, where it
is the resumed run's first sync):
  1. the actor offloads, before anything of vLLM comes back;
  2. the engines wake their weights;
  3. the weight sync (``steps.sync_weights``), when the engines' weights are stale (an update since the
     last sync, a resumed checkpoint) or were dropped (level 2);
  4. the engines wake their KV cache, the largest part, once the sync's buckets are gone.

At start-up (``megatron_arpo.trainer.runtime``) the engines come first: up, profiled, their KV cache
checked against the plan and, with sleep mode, asleep, before the actor allocates anything; the first
switch to ``"rollout"`` then wakes them (and syncs, since level 2 dropped their weights). `PhaseState.events`
records the order.

The planner (``launchers.planner``) counts exactly this: with both switches a GPU holds the larger of
the two phases, ``max(actor peak, vLLM reservation + actor weights)``, instead of their sum. The state
(``PhaseState``) lives on the Runtime. With neither switch (the default, and always on separate
placement, where the config refuses both), the switch to ``"train"`` does nothing and the switch to
``"rollout"`` is the sync after an update, as before. Each switch is idempotent. A checkpoint taken
while the actor is offloaded onloads for the save's duration (``MegatronActorWorker.save``); on a stop
request the loop skips the switch to ``"rollout"`` (the engines restart from the checkpoint anyway).
The reference group (``algorithm.use_reference``) stays resident: it holds bf16 weights only.

On CPU, vLLM refuses ``enable_sleep_mode``; the engines still run ``sleep``/``wake_up`` (vLLM pauses and
resumes its scheduler and tracks the tags; its CPU worker frees nothing), and the actor's offload really
moves its state to host buffers, so the CPU tests run this order for real. What only a GPU run can
confirm is listed in docs/memory.md (section "Colocated GPUs: sleep and offload").
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional

from megatron_arpo.trainer.state import Runtime
from megatron_arpo.trainer.steps import sync_weights

logger = logging.getLogger(__name__)

PHASES = ("rollout", "train")


def _timed(metrics: dict[str, float], key: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    out = fn()
    metrics[f"phase/{key}_s"] = metrics.get(f"phase/{key}_s", 0.0) + time.perf_counter() - start
    return out


def _on_engines(rt: Runtime, method: str, *args: Any) -> list:
    """``method`` on every engine actor at once, bounded by ``trainer.timeouts.sync_s``."""
    async def call() -> list:
        return list(await asyncio.gather(*(getattr(e, method).remote(*args) for e in rt.engines)))

    return rt.run_async(call(), rt.cfg.trainer.timeouts.sync_s, f"the engines' {method}{args}",
                        "trainer.timeouts.sync_s")


def sleep_engines(rt: Runtime, metrics: Optional[dict] = None) -> None:
    """The engines release their memory (level ``rollout.sleep_level``); a no-op without sleep mode."""
    st = rt.phases
    if st.sleep_level is None or st.engines_asleep:
        return
    _timed(metrics if metrics is not None else {}, "sleep", lambda: _on_engines(rt, "sleep", st.sleep_level))
    st.engines_asleep, st.weights_dropped = True, st.sleep_level == 2
    st.note(f"engines asleep (level {st.sleep_level})")


def switch_phase(rt: Runtime, target: str) -> dict[str, float]:
    """Bring the colocated GPUs into ``target`` (see the module docstring); returns the phase metrics
    (``phase/*_s``, ``phase/offload_*``) and, when it synced, the sync metrics (``sync/*``)."""
    if target not in PHASES:
        raise ValueError(f"unknown phase {target!r}; allowed: {PHASES}")
    st, metrics = rt.phases, {}
    if target == "train":
        sleep_engines(rt, metrics)
        if st.actor_offloaded:
            metrics.update(_timed(metrics, "onload", rt.actor.onload_state))
            st.actor_offloaded = False
            st.note("actor onloaded")
    else:
        if st.offload and not st.actor_offloaded and rt.actor is not None:
            moved = _timed(metrics, "offload", rt.actor.offload_state)
            metrics["phase/offload_optimizer_gib"] = moved.get("offload_optimizer_bytes", 0.0) / 2**30
            metrics["phase/offload_grad_gib"] = moved.get("offload_grad_bytes", 0.0) / 2**30
            st.actor_offloaded = True
            st.note("actor offloaded")
        if st.engines_asleep:
            _timed(metrics, "wake_weights", lambda: _on_engines(rt, "wake_up", ["weights"]))
            st.note("engines woke their weights")
        if st.weights_stale or st.weights_dropped:
            metrics.update(sync_weights(rt))
            st.weights_stale = st.weights_dropped = False
            st.note("weights synced")
        if st.engines_asleep:
            _timed(metrics, "wake_kv_cache", lambda: _on_engines(rt, "wake_up", ["kv_cache"]))
            st.engines_asleep = False
            st.note("engines woke their KV cache")
    st.phase = target
    return {k: v for k, v in metrics.items() if not k.startswith(("offload_", "onload_"))}
