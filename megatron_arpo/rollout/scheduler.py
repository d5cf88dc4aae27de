"""ARPO's branched tool-use rollout as asyncio tasks: one task per trajectory, no round barrier.

Per prompt there is a global budget ``n`` of trajectories. ``initial_rollouts`` start from the prompt; the
rest come from branches (copies forked at a tool-result boundary) and, when every trajectory of the prompt
has ended with budget left, from fresh rollouts. Every prompt ends with exactly ``n`` trajectories.

Rules, and where they differ from the reference (docs/design/arpo_reference.md §2, §4, §12):

- **No round barrier.** A trajectory generates a segment (until a tool closing tag, EOS or its budget),
  runs its tool call, splices the result and continues as soon as its own result is back; the engine
  batches whatever requests are in flight. ``scheduler="barrier"`` adds the reference's per-round
  barrier (every active trajectory finishes its segment and tool call before any starts the next one);
  it exists to measure the difference (benchmarks/rollout.py) and builds the same trees.
- **Entropy.** `segment_entropy` over the first ``entropy_window`` generated tokens of a segment, from the
  engine's top-k log-probs; estimator ``reference`` (the reference's value) or ``mean``. Top-k is asked
  only where a decision reads it; every other request returns the sampled tokens' log-probs alone (vLLM
  computes top-k for every position of a request that asks for any). The after-result probe carries it
  (its ``entropy_window`` tokens are a request of their own), and so do AEPO's H_root sample and
  pre-monitoring. A segment that ended with a tool call whose entropy a decision reads (H0 of a root
  path; every call with ``branch_timing="reference"``) is measured by an *entropy request* while the tool
  runs: its first request again, same context and seed, ``max_tokens`` = the window, with top-k. A seeded
  request repeats its leading tokens, so the entropy and every token are those of one request asking
  top-k for the window (tests/unit/test_rollout_before_after.py); splitting the segment instead would
  re-seed its continuation. Other segments record no entropy (None) unless ``rollout.entropy_metrics``;
  GRPO asks for no top-k at all.
- **Baseline H0** is the entropy of the first segment of the trajectory's path (the segment generated
  from the prompt). It lives on the trajectory, so it is fresh for every rollout call and keyed by
  trajectory (fixes Q1). Branch copies inherit their parent's H0 (the reference gives a copy the
  entropy of its own first segment, so its first decision always has ΔH = 0); fresh fills measure their own.
- **Branching** after a tool result, up to ``beam_size - 1`` draws, each creating one copy if the rule of
  `megatron_arpo.algo.branching.should_branch` holds (ARPO, or AEPO with ``variant="aepo"``) and budget is
  left. Whether a prompt branches at all is decided on its computed initial count (`RolloutOptions.branches`:
  ``beam_size > 1`` and fewer initial trajectories than ``n``), so AEPO's dynamic count branches even when
  ``rollout.initial_rollouts == n``. U comes from a `BranchRng` stream per trajectory (spawned from the
  prompt's stream by trajectory id); every draw, score and entropy is recorded on the trajectory.
  ``branch_timing="after_result"`` (default, the paper's): after the result the trajectory generates its
  first ``entropy_window`` tokens as a probe, the decision uses their entropy, copies fork at the result
  boundary and re-sample from there, and the trajectory continues its own segment (one more request,
  prefix-cached). Every after-result decision is probed, also one that will find no slot: whether a
  segment is split changes its requests' seeds, so it must not depend on how many slots happen to be left
  at that moment. ``branch_timing="reference"``: the decision uses the segment that ended with the tool
  call and forks right after the result, like the reference (Q4).
- **Deterministic allocation** (`megatron_arpo.rollout.ledger`): the same seed, prompts and policy give the
  same tree whatever the tool and engine latencies, in both schedulers (async and barrier build identical
  trees). Decisions take budget slots in the canonical order (k, i), k = tool results on the path, i = the
  trajectory's creation index in its prompt (the reference's round-then-index order); a decision resolves
  once no live trajectory can still produce an earlier-ranked one. Only the spawning of copies waits for
  that; every trajectory, the deciding parent included, runs on. Everything a trajectory's tokens depend
  on is a function of the tree: its id (and so its request seeds and U stream) comes from its lineage, its
  index from the canonical order, a fill's from the fill count, the AEPO counter from its path.
- **Budget**: never more than ``n`` per prompt; a decision with no slot left draws nothing (as the
  reference). When all trajectories of a prompt have ended, all missing ones start at once (fixes Q8).
  A prompt starting ``n`` trajectories is plain GRPO sampling.
- **AEPO**: ``dynamic_initial_rollouts`` runs the §4.1 pre-monitoring per prompt (one sample of
  ``initial_entropy_tokens`` tokens for H_root, one complete unbranched tool trajectory for H̄_tool; both
  discarded) and starts ``aepo_initial_rollouts(n, H_root - H̄_tool)`` trajectories. The consecutive-branch
  penalty counts per PATH: a trajectory's counter is the number of consecutive tool-result boundaries on
  its lineage at which it branched; copies inherit the incremented count, a boundary without a branch
  resets it. The reference counts per PROMPT, increments for fills too and leaves counters untouched in
  rounds where nobody branched (Q11).
- **Tool calls** are found on text by `TagProtocol.find_call` (closing tags are the engine's stop strings):
  the trajectory keeps the sampled tokens up to and including the one that completed the closing tag,
  even when the tag ends inside it; tokens sampled after it (a tag split over the after-result probe
  and its continuation, which the engine's stop check cannot see) are dropped and counted in
  ``tokens_after_stop_dropped``. An engine stop that the segment's text does not explain (a vLLM
  detokenizer artefact, see `_generate_segment`) continues the segment (``engine_stops_outside_segment``).
- **Guards**: ``call_limit`` tool calls per trajectory (a call beyond it gets EOS appended with loss mask
  1 and the trajectory ends, as the reference); ``max_tokens`` of each request = that trajectory's
  remaining response budget (no overshoot, Q7; a result block that does not fit is cut and the
  trajectory ends); an empty query gets the executor's error result and the trajectory continues (Q5).
- **Validation** (`RolloutOptions.for_validation`): greedy, n = 1, no branching.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from megatron_arpo.algo.branching import BranchRng, aepo_initial_rollouts, branch_score, should_branch
from megatron_arpo.algo.entropy import segment_entropy
from megatron_arpo.rollout.config import RolloutSection
from megatron_arpo.rollout.engine import SegmentOutput, SegmentRequest
from megatron_arpo.rollout.group import EngineHandle, RolloutGroup
from megatron_arpo.rollout.ledger import DecisionLedger, PendingDecision
from megatron_arpo.rollout.protocol import TagProtocol
from megatron_arpo.rollout.trajectory import BranchDecision, Segment, ToolCall, Trajectory, shared_prefix_tokens

logger = logging.getLogger(__name__)

__all__ = ["RolloutOptions", "RolloutPrompt", "RolloutResult", "RolloutScheduler", "run_rollout"]


@dataclass(frozen=True)
class RolloutOptions(RolloutSection):
    """Scheduler options: the ``rollout`` config section (every setting and default) plus run-time switches."""

    greedy: bool = False
    # Test steering only: sampling restricted to these ids (at most 1024, vLLM's GPU limit). Training never
    # sets it (no 151k-id allow-list per request): the sampled ids are checked after the fact instead.
    allowed_token_ids: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        choices = {"entropy_estimator": ("reference", "mean"), "branch_timing": ("after_result", "reference"),
                   "variant": ("arpo", "aepo"), "scheduler": ("async", "barrier")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"rollout.{key}={getattr(self, key)!r}; allowed: {', '.join(allowed)}")
        for key in ("n", "initial_rollouts", "beam_size", "entropy_window", "logprobs_topk",
                    "initial_entropy_tokens", "response_length"):
            if getattr(self, key) < 1:
                raise ValueError(f"rollout.{key}={getattr(self, key)} must be >= 1")
        if self.initial_rollouts > self.n:
            raise ValueError(f"rollout.initial_rollouts={self.initial_rollouts} exceeds rollout.n={self.n}; "
                             f"set it to at most {self.n} (= n is plain GRPO)")
        if self.call_limit < 0:
            raise ValueError(f"rollout.call_limit={self.call_limit} must be >= 0")

    @classmethod
    def from_config(cls, section: RolloutSection, **overrides: Any) -> "RolloutOptions":
        """The ``rollout`` section's values, with ``overrides`` (``greedy``, ``allowed_token_ids``, ...)."""
        values = {f.name: getattr(section, f.name) for f in dataclasses.fields(RolloutSection)}
        values.update(overrides)
        return cls(**values)

    def for_validation(self) -> "RolloutOptions":
        return dataclasses.replace(self, n=1, initial_rollouts=1, beam_size=1, greedy=True,
                                   dynamic_initial_rollouts=False)

    def branches(self, initial_rollouts: int) -> bool:
        """Whether a prompt that starts ``initial_rollouts`` trajectories branches: decided per prompt on the
        computed count (AEPO's dynamic count may be below ``n`` even when ``rollout.initial_rollouts == n``)."""
        return self.beam_size > 1 and initial_rollouts < self.n and not self.greedy


@dataclass
class RolloutPrompt:
    prompt_id: str
    token_ids: list[int]


@dataclass
class RolloutResult:
    groups: list[list[Trajectory]]      # per prompt, in creation order, exactly n each
    prompt_info: list[dict[str, Any]]
    stats: dict[str, float]

    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g]


class _Live:
    """A running trajectory: the record plus scheduler-only state."""

    def __init__(self, traj: Trajectory, rng: BranchRng, counted: bool = True):
        self.traj = traj
        self.rng = rng
        self.counted = counted          # False for AEPO pre-monitoring (not part of the group)
        self.probe_for: Optional[PendingDecision] = None   # after_result: the next segment's probe measures it
        self.call: Any = None           # the StopMatch the last segment ended with (None: EOS or length)
        self.num_own_segments = 0
        self.entropy_request: Optional[_EntropyRequest] = None   # the last segment's entropy, still to measure


@dataclass
class _EntropyRequest:
    """The entropy of a segment whose requests asked for no top-k, to measure while its tool call runs: the
    segment's first request again (same context and seed, so the same leading tokens), ``max_tokens`` = the
    window, with top-k. ``rest``: top-k of later requests of the segment that still lay in the window."""

    segment: Segment
    request: SegmentRequest
    expected: list[int]
    rest: list[dict[int, float]]


class _PromptRun:
    def __init__(self, index: int, spec: RolloutPrompt, engine: EngineHandle, n: int, rng: BranchRng):
        self.index = index
        self.spec = spec
        self.engine = engine
        self.n = n
        self.rng = rng
        self.count = 0                  # trajectories created (the budget counter)
        self.active = 0
        self.trajs: list[Trajectory] = []
        self.num_fills = 0
        self.branching = False          # set once the initial count is known (`RolloutOptions.branches`)
        self.ledger = DecisionLedger()
        self.info: dict[str, Any] = {"prompt_id": spec.prompt_id, "engine_index": engine.index}
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()


class _Phaser:
    """A reusable barrier with a changing number of parties (the reference's rounds)."""

    def __init__(self) -> None:
        self.parties = 0
        self.arrived = 0
        self.rounds = 0
        self._event = asyncio.Event()

    def register(self) -> None:
        self.parties += 1

    def deregister(self) -> None:
        self.parties -= 1
        self._maybe_advance()

    async def arrive_and_wait(self) -> None:
        self.arrived += 1
        event = self._event
        self._maybe_advance()
        await event.wait()

    def _maybe_advance(self) -> None:
        if self.arrived > 0 and self.arrived >= self.parties:
            event, self._event = self._event, asyncio.Event()
            self.arrived = 0
            self.rounds += 1
            event.set()


def _derive_seed(*parts: Any) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class RolloutScheduler:
    """Runs one rollout call (a batch of prompts) on a `RolloutGroup` with a tool executor.

    ``tools``: anything with ``async execute(tag, query) -> ToolResult`` (megatron_arpo.tools.ToolExecutor).
    ``rng``: the base branch stream; default ``BranchRng(options.seed)``. Each call gets its own key
    (``call_key``, default a counter), so successive calls draw fresh values.
    """

    def __init__(self, group: RolloutGroup, tools: Any, protocol: TagProtocol, options: RolloutOptions,
                 rng: Optional[BranchRng] = None):
        self.group = group
        self.tools = tools
        self.protocol = protocol
        self.options = options
        self.rng = rng if rng is not None else BranchRng(options.seed)
        self._num_calls = 0

    async def run(self, prompts: Sequence[RolloutPrompt | Sequence[int]], call_key: Any = None,
                  options: Optional[RolloutOptions] = None) -> RolloutResult:
        run = _Run(self, [p if isinstance(p, RolloutPrompt) else RolloutPrompt(str(i), list(p))
                          for i, p in enumerate(prompts)],
                   options or self.options,
                   call_key if call_key is not None else self._num_calls)
        self._num_calls += 1
        return await run.execute()


async def run_rollout(group: RolloutGroup, tools: Any, protocol: TagProtocol, options: RolloutOptions,
                      prompts: Sequence[RolloutPrompt | Sequence[int]], rng: Optional[BranchRng] = None,
                      call_key: Any = None) -> RolloutResult:
    return await RolloutScheduler(group, tools, protocol, options, rng).run(prompts, call_key)


class _Run:
    """State of one rollout call."""

    def __init__(self, scheduler: RolloutScheduler, prompts: list[RolloutPrompt], options: RolloutOptions,
                 call_key: Any):
        self.s = scheduler
        self.o = options
        self.protocol = scheduler.protocol
        self.prompts = prompts
        self.call_key = call_key
        self.call_rng = scheduler.rng.spawn(f"call/{call_key}")
        self.phaser = _Phaser() if options.scheduler == "barrier" else None
        self.tasks: set[asyncio.Task] = set()
        self.stats: dict[str, float] = {
            "engine_requests": 0, "engine_prompt_tokens": 0, "engine_cached_tokens": 0, "generated_tokens": 0,
            "tool_calls": 0, "tool_errors": 0, "call_limit_hits": 0, "branches": 0, "fills": 0, "draws": 0,
            "premonitor_tool_calls": 0, "premonitor_generated_tokens": 0, "tokens_after_stop_dropped": 0,
            "engine_stops_outside_segment": 0, "entropy_requests": 0, "entropy_request_mismatches": 0,
        }
        ids = [p.prompt_id for p in prompts]
        if len(set(ids)) != len(ids):
            dup = sorted({i for i in ids if ids.count(i) > 1})
            raise ValueError(f"prompt ids must be unique within a rollout call (trajectory ids derive from them); "
                             f"repeated: {dup[:5]}")
        for p in prompts:
            limit = options.max_model_len
            if limit is not None and len(p.token_ids) >= limit:
                raise ValueError(f"prompt {p.prompt_id} has {len(p.token_ids)} tokens, not below "
                                 f"max_model_len={limit}; shorten it or raise rollout.max_model_len")
            if not p.token_ids:
                raise ValueError(f"prompt {p.prompt_id} is empty")

    async def execute(self) -> RolloutResult:
        start = time.monotonic()
        runs = []
        for index, spec in enumerate(self.prompts):
            pr = _PromptRun(index, spec, self.s.group.assign((self.call_key, index)), self.o.n,
                            self.call_rng.spawn(f"prompt/{index}/{spec.prompt_id}"))
            runs.append(pr)
            if self.phaser is not None:
                self.phaser.register()  # placeholder party until the prompt's initial trajectories exist
        try:
            await asyncio.gather(*(self._run_prompt(pr) for pr in runs))
        except BaseException:
            for pr in runs:  # unblock the other prompts' coroutines still waiting on their groups
                if not pr.done.done():
                    pr.done.cancel()
            raise
        finally:
            for task in list(self.tasks):
                task.cancel()
            for pr in runs:
                self.s.group.release((self.call_key, pr.index))
        groups = [sorted(pr.trajs, key=lambda t: t.index) for pr in runs]
        for pr, group in zip(runs, groups):
            pr.info["tool_calls"] = sum(1 for t in group for c in t.tool_calls if c.owner == t.traj_id)
            pr.info["fills"] = pr.num_fills
        for group in groups:
            assert len(group) == self.o.n, f"group has {len(group)} trajectories, expected {self.o.n}"
        flat = [t for g in groups for t in g]
        self.stats["wall_s"] = time.monotonic() - start
        self.stats["shared_prefix_tokens"] = float(shared_prefix_tokens(flat))
        self.stats["num_prompts"] = float(len(runs))
        self.stats["num_trajectories"] = float(len(flat))
        if self.phaser is not None:
            self.stats["barrier_rounds"] = float(self.phaser.rounds)
        return RolloutResult(groups=groups, prompt_info=[pr.info for pr in runs], stats=self.stats)

    # ------------------------------------------------------------------ per prompt
    async def _run_prompt(self, pr: _PromptRun) -> None:
        try:
            initial = min(max(self.o.initial_rollouts, 1), self.o.n)
            if self.o.dynamic_initial_rollouts and not self.o.greedy:
                initial = await self._premonitor(pr)
            pr.info["initial_rollouts"] = initial
            pr.branching = self.o.branches(initial)
            for k in range(initial):
                self._spawn(pr, self._new_root(pr, k, "initial"))
        finally:
            if self.phaser is not None:
                self.phaser.deregister()
        await pr.done

    def _new_root(self, pr: _PromptRun, k: int, origin: str) -> _Live:
        traj_id = f"{pr.spec.prompt_id}/{k}" if origin == "initial" else f"{pr.spec.prompt_id}/f{k}"
        traj = Trajectory(prompt_id=pr.spec.prompt_id, prompt_index=pr.index, traj_id=traj_id, index=pr.count,
                          origin=origin, parent_id=None, branch_offset=None,
                          prompt_token_ids=list(pr.spec.token_ids), engine_index=pr.engine.index)
        return _Live(traj, pr.rng.spawn(traj_id))

    def _spawn(self, pr: _PromptRun, live: _Live) -> None:
        """Start a counted trajectory; its first decision can come after its next tool result."""
        pr.count += 1
        pr.active += 1
        pr.trajs.append(live.traj)
        pr.ledger.open(live.traj.index, len(live.traj.tool_calls) + 1)
        if self.phaser is not None:
            self.phaser.register()
        task = asyncio.get_running_loop().create_task(self._run_trajectory(pr, live), name=live.traj.traj_id)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run_trajectory(self, pr: _PromptRun, live: _Live) -> None:
        try:
            await self._run_loop(pr, live)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # delivered to the rollout call through the prompt's future
            if not pr.done.done():
                pr.done.set_exception(exc)
            return
        finally:
            pr.active -= 1
            pr.ledger.close(live.traj.index)
            if self.phaser is not None:
                self.phaser.deregister()
        try:
            self._resolve(pr)  # this trajectory's end may let earlier-ranked decisions of others resolve
            if pr.active == 0 and not pr.done.done():
                assert pr.ledger.num_pending == 0, "decisions left unresolved with no trajectory running"
                missing = pr.n - pr.count
                if missing > 0:
                    # Q8: every missing trajectory starts now, not one per round.
                    for _ in range(missing):
                        self._spawn(pr, self._new_root(pr, pr.num_fills, "fill"))
                        pr.num_fills += 1
                        self.stats["fills"] += 1
                else:
                    pr.done.set_result(None)
        except Exception as exc:
            if not pr.done.done():
                pr.done.set_exception(exc)

    # ------------------------------------------------------------------ one trajectory
    def _budget(self, traj: Trajectory) -> tuple[int, str]:
        by_response = self.o.response_length - len(traj.response_ids)
        if self.o.max_model_len is not None:
            by_model = self.o.max_model_len - len(traj.prompt_token_ids) - len(traj.response_ids)
            if by_model < by_response:
                return by_model, "max_model_len"
        return by_response, "length"

    async def _run_loop(self, pr: _PromptRun, live: _Live) -> None:
        t = live.traj
        while t.finish_reason is None:
            if self.phaser is not None and live.counted:
                await self.phaser.arrive_and_wait()
            seg = await self._generate_segment(pr, live)
            if seg is None:
                break
            if seg.finish == "eos":
                t.finish_reason = "eos"
            elif seg.finish == "length":
                t.finish_reason = self._budget(t)[1]
            else:
                await self._tool_step(pr, live, seg)
        if live.counted:
            self.stats["generated_tokens"] += sum(s.num_tokens for s in t.segments if s.owner == t.traj_id)

    def _segment_request(self, live: _Live, part: int, max_tokens: int, top_positions: int,
                         context: Optional[list[int]] = None, suffix: str = "") -> SegmentRequest:
        t = live.traj
        return SegmentRequest(
            request_id=f"{self.call_key}:{t.traj_id}:s{live.num_own_segments}.{part}{suffix}",
            prompt_token_ids=t.context() if context is None else context, max_tokens=max_tokens,
            stop_token_ids=self.protocol.stop_token_ids, stop=self.protocol.stop_strings,
            seed=_derive_seed(self.o.seed, self.call_key, t.traj_id, live.num_own_segments, part),
            temperature=0.0 if self.o.greedy else self.o.temperature,
            top_p=1.0 if self.o.greedy else self.o.top_p, top_k=-1 if self.o.greedy else self.o.top_k,
            logprobs=self.o.logprobs_topk, top_logprobs_positions=top_positions,
            allowed_token_ids=None if self.o.allowed_token_ids is None else list(self.o.allowed_token_ids),
        )

    async def _request(self, pr: _PromptRun, live: _Live, part: int, max_tokens: int,
                       top_positions: int) -> SegmentOutput:
        """``top_positions``: leading generated positions whose top-k the entropy needs (the rest of the
        segment only returns the sampled tokens' log-probs)."""
        t = live.traj
        req = self._segment_request(live, part, max_tokens, top_positions)
        request_id = req.request_id
        out = await pr.engine.generate(req)
        if not out.token_ids:
            raise RuntimeError(f"engine {pr.engine.index} returned no tokens for {request_id}")
        beyond = [i for i in out.token_ids if i >= self.protocol.num_token_ids]
        if beyond:  # sampling is not restricted (no 151k-id allow-list per request): check what came back
            raise RuntimeError(f"engine {pr.engine.index} sampled token id {beyond[0]} for {request_id}, beyond the "
                               f"tokenizer's {self.protocol.num_token_ids} ids (a padded LM-head row); the policy's "
                               f"LM head and the tokenizer disagree: check model.hf_checkpoint and model.tokenizer")
        if len(out.token_ids) > max_tokens:
            raise RuntimeError(f"engine {pr.engine.index} returned {len(out.token_ids)} tokens for {request_id} "
                               f"with max_tokens={max_tokens}")
        # Each token's policy version: the engine's report where it gives one (a weight update in flight can
        # change it mid-request), else the version of the weights it holds.
        t.append(out.token_ids, out.logprobs, 1, getattr(out, "token_versions", None) or pr.engine.version)
        if getattr(out, "routed_experts", None) is not None:  # routing replay (EngineConfig.return_routed_experts)
            t.record_routing(out.routed_experts)
        if live.counted:
            self.stats["engine_requests"] += 1
            self.stats["engine_prompt_tokens"] += out.num_prompt_tokens
            self.stats["engine_cached_tokens"] += out.num_cached_tokens
        return out

    def _entropy(self, top_logprobs: Sequence[Any]) -> float:
        return segment_entropy(top_logprobs, self.protocol.vocab_size, window=self.o.entropy_window,
                               estimator=self.o.entropy_estimator)

    async def _generate_segment(self, pr: _PromptRun, live: _Live) -> Optional[Segment]:
        t = live.traj
        budget, bound = self._budget(t)
        if budget <= 0:
            t.finish_reason = bound
            return None
        start = len(t.response_ids)
        # Every registered after-result decision is probed, whether or not a slot will be left for it: the
        # split changes the requests' seeds and so the tokens, and the slots left at this moment depend on
        # latencies. (A decision that finds no slot costs one extra, prefix-cached request.)
        pending, live.probe_for = live.probe_for, None
        probe = pending is not None
        window = self.o.entropy_window
        # Top-k where the entropy is read at once: the probe, AEPO's pre-monitoring, rollout.entropy_metrics.
        # Any other segment asks for the sampled log-probs alone; if a decision will read its entropy (known
        # once it ends with a tool call), `_measure_entropy` measures it while the tool runs.
        measured = probe or not live.counted or self.o.entropy_metrics
        if probe:
            out = await self._request(pr, live, 0, min(window, budget), window)
            parts = [out]
            pending.h_now = self._entropy(out.top_logprobs)
            self._resolve(pr)
        else:
            parts = [await self._request(pr, live, 0, budget, window if measured else 0)]
        # Tool calls are found on the segment's text; the engine's stop reason is not trusted for them. A
        # closing tag split over the probe and its continuation is invisible to the engine's stop check, and
        # the engine may stop on a tag that is not in the segment: vLLM 0.32 primes its detokenizer with the
        # whole context, and when the context ends inside a UTF-8 character (a probe cut mid-character) the
        # first generated token's text comes back with the context's text, so a closing tag anywhere in the
        # context (the system prompt has some) ends the request after one token. Such a segment goes on.
        while True:
            call = live.call = self.protocol.find_call(t.response_ids[start:])
            last = parts[-1]
            if call is not None or self.protocol.is_end(last.token_ids[-1]) or self._budget(t)[0] <= 0:
                break
            if last.finish_reason == "stop":
                self.stats["engine_stops_outside_segment"] += 1
                if self.stats["engine_stops_outside_segment"] == 1:
                    logger.warning("engine stopped %s on %r, which is not in the segment's text (a tag in the "
                                   "context, see the scheduler's notes); the segment continues", last.request_id,
                                   last.stop_reason)
            elif not (probe and len(parts) == 1):
                break  # a request that ran to its max_tokens
            done = len(t.response_ids) - start  # top-k only for what is left of the window
            parts.append(await self._request(pr, live, len(parts), self._budget(t)[0],
                                             max(0, window - done) if measured or pr.branching else 0))
        top = [entry for out in parts for entry in out.top_logprobs]
        if call is not None:
            keep = start + call.num_tokens
            if keep < len(t.response_ids):  # sampled tokens after the tag's last token are not kept
                self.stats["tokens_after_stop_dropped"] += len(t.response_ids) - keep
                t.truncate(keep)
                top = top[:call.num_tokens]
            finish = f"tool:{call.tag}"
        elif self.protocol.is_end(last.token_ids[-1]):
            finish = "eos"
        else:
            finish = "length"
        seg = Segment(owner=t.traj_id, index=live.num_own_segments, start=start,
                      num_tokens=len(t.response_ids) - start,
                      entropy=self._entropy(top) if measured else None, finish=finish,
                      num_requests=len(parts), num_prompt_tokens=parts[0].num_prompt_tokens,
                      num_cached_tokens=sum(p.num_cached_tokens for p in parts))
        if not measured and call is not None and self._reads_entropy(pr, live):
            first = parts[0].token_ids
            live.entropy_request = _EntropyRequest(
                segment=seg, request=self._segment_request(live, 0, min(window, len(first)), window,
                                                           t.prompt_token_ids + t.response_ids[:start], "h"),
                expected=first[:window], rest=[entry for out in parts[1:] for entry in out.top_logprobs])
        t.segments.append(seg)
        live.num_own_segments += 1
        if t.baseline_entropy is None and measured:
            t.baseline_entropy = seg.entropy
        return seg

    def _reads_entropy(self, pr: _PromptRun, live: _Live) -> bool:
        """Whether a decision will read the entropy of the segment that just ended with a tool call: the
        decision after its result (branch_timing reference), or later ones through the baseline H0 (the
        first segment of a root's path)."""
        t = live.traj
        return (live.counted and pr.branching and len(t.tool_calls) < self.o.call_limit
                and (self.o.branch_timing == "reference" or t.baseline_entropy is None))

    async def _measure_entropy(self, pr: _PromptRun, live: _Live) -> None:
        """Run the pending `_EntropyRequest` of the last segment; set its entropy (and H0 if it is the first)."""
        pending, live.entropy_request = live.entropy_request, None
        if pending is None:
            return
        out = await pr.engine.generate(pending.request)
        self.stats["entropy_requests"] += 1
        self.stats["engine_requests"] += 1
        self.stats["engine_prompt_tokens"] += out.num_prompt_tokens
        self.stats["engine_cached_tokens"] += out.num_cached_tokens
        agree = 0
        for got, want in zip(out.token_ids, pending.expected):
            if got != want:
                break
            agree += 1
        top = out.top_logprobs[:agree]
        if agree < len(pending.expected):
            # Seeded sampling repeats itself unless the engine's numerics changed with the batch: the entropy
            # is then taken over the positions that still follow the segment.
            self.stats["entropy_request_mismatches"] += 1
            if self.stats["entropy_request_mismatches"] == 1:
                logger.warning("entropy request %s sampled %d of %d leading tokens as the segment did; its "
                               "entropy uses those", pending.request.request_id, agree, len(pending.expected))
        else:
            top += pending.rest
        seg = pending.segment
        seg.entropy = self._entropy(top[:seg.num_tokens])
        if live.traj.baseline_entropy is None:
            live.traj.baseline_entropy = seg.entropy

    async def _tool_step(self, pr: _PromptRun, live: _Live, seg: Segment) -> None:
        t = live.traj
        if len(t.tool_calls) >= self.o.call_limit:
            # As the reference: the call is not executed, EOS is appended (trained on, mask 1), the end.
            if self._budget(t)[0] > 0:
                t.append([self.protocol.eos_token_id], [0.0], 1)
            t.call_limit_hit = True
            t.finish_reason = "call_limit"
            if live.counted:
                self.stats["call_limit_hits"] += 1
            return
        call = live.call
        assert call is not None and call.num_tokens == seg.num_tokens, "a tool segment must end with its call"
        result, _ = await asyncio.gather(self.s.tools.execute(call.tag, call.query), self._measure_entropy(pr, live))
        result_ids = self.protocol.encode_result(result.text)
        budget = self._budget(t)[0]
        kept = result_ids[:max(budget, 0)]
        t.tool_calls.append(ToolCall(
            tool=call.tag, query=call.query, result_text=result.text, latency_s=float(result.latency_s),
            cached=bool(result.cached), error=result.error, truncated=bool(result.truncated),
            call_offset=len(t.response_ids), result_offset=len(t.response_ids), num_result_tokens=len(kept),
            owner=t.traj_id))
        t.append(kept, [0.0] * len(kept), 0)
        if live.counted:
            self.stats["tool_calls"] += 1
            self.stats["tool_errors"] += int(result.error is not None)
        else:
            self.stats["premonitor_tool_calls"] += 1
        if len(kept) < len(result_ids) or self._budget(t)[0] <= 0:
            t.finish_reason = self._budget(t)[1]
            return
        if live.counted and pr.branching:
            decision = PendingDecision(k=len(t.tool_calls), index=t.index, at_offset=len(t.response_ids),
                                       timing=self.o.branch_timing, owner=live)
            pr.ledger.register(decision)
            if self.o.branch_timing == "reference":
                decision.h_now = seg.entropy
                self._resolve(pr)
            else:
                live.probe_for = decision

    # ------------------------------------------------------------------ branching
    def _resolve(self, pr: _PromptRun) -> None:
        """Resolve the prompt's decisions whose turn has come, in canonical order (`rollout.ledger`)."""
        while (decision := pr.ledger.pop_resolvable(budget_left=pr.count < pr.n)) is not None:
            self._decide(pr, decision)

    def _decide(self, pr: _PromptRun, pending: PendingDecision) -> None:
        live = pending.owner
        t = live.traj
        slots = pr.n - pr.count
        if slots <= 0:
            return  # no draw, as the reference
        h_now = pending.h_now
        h0 = t.baseline_entropy if t.baseline_entropy is not None else h_now
        consecutive = t.consecutive_branches if self.o.variant == "aepo" else 0
        kwargs = dict(entropy_weight=self.o.entropy_weight, variant=self.o.variant,
                      consecutive_branches=consecutive, penalty=self.o.consecutive_branch_penalty)
        children = []
        for j in range(min(self.o.beam_size - 1, slots)):
            u = live.rng.draw()
            self.stats["draws"] += 1
            decision = BranchDecision(
                at_offset=pending.at_offset, tool_call_index=pending.k - 1, timing=pending.timing,
                h_now=h_now, h0=h0, u=u, score=branch_score(u, h_now, h0, **kwargs), consecutive=consecutive,
                branched=should_branch(u, h_now, h0, threshold=self.o.branch_threshold, **kwargs))
            if decision.branched:
                child_id = f"{t.traj_id}/b{pending.k}.{j}"
                child = t.fork(child_id, pr.count, pending.at_offset)
                decision.child_id = child_id
                children.append(child)
                self._spawn(pr, _Live(child, pr.rng.spawn(child_id)))
                self.stats["branches"] += 1
            t.decisions.append(decision)
        if self.o.variant == "aepo":
            t.consecutive_branches = consecutive + 1 if children else 0
            for child in children:
                child.consecutive_branches = t.consecutive_branches

    # ------------------------------------------------------------------ AEPO pre-monitoring (§4.1)
    async def _premonitor(self, pr: _PromptRun) -> int:
        probe_id = f"{pr.spec.prompt_id}/premonitor"
        root = Trajectory(prompt_id=pr.spec.prompt_id, prompt_index=pr.index, traj_id=f"{probe_id}-root", index=-1,
                          origin="premonitor", parent_id=None, branch_offset=None,
                          prompt_token_ids=list(pr.spec.token_ids), engine_index=pr.engine.index)
        root_live = _Live(root, pr.rng.spawn(root.traj_id), counted=False)
        out = await self._request(pr, root_live, 0, max(1, min(self.o.initial_entropy_tokens, self._budget(root)[0])),
                                  self.o.entropy_window)
        h_root = self._entropy(out.top_logprobs)
        tool_traj = dataclasses.replace(root, traj_id=f"{probe_id}-tool", response_ids=[], response_logprobs=[],
                                        token_versions=[], loss_mask=[], segments=[], tool_calls=[], decisions=[])
        tool_live = _Live(tool_traj, pr.rng.spawn(tool_traj.traj_id), counted=False)
        await self._run_loop(pr, tool_live)
        h_tool = [s.entropy for s in tool_traj.segments]
        mean_tool = sum(h_tool) / len(h_tool) if h_tool else h_root
        m = aepo_initial_rollouts(self.o.n, h_root - mean_tool)
        self.stats["premonitor_generated_tokens"] += len(out.token_ids) + sum(s.num_tokens for s in tool_traj.segments)
        pr.info["premonitor"] = {"h_root": h_root, "h_tool": h_tool, "delta_h": h_root - mean_tool,
                                 "initial_rollouts": m}
        return m
