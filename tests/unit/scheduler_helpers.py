"""Shared pieces of the scheduler tests: the §11.7 scripted policy, a latency-controlled search tool, scripted U
streams, and record checks (docs/design/arpo_reference.md §11.7)."""

from __future__ import annotations

import asyncio
import math
import re
from typing import Callable, Optional

from megatron_arpo.rollout.group import RolloutGroup
from megatron_arpo.rollout.protocol import TagProtocol
from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutScheduler
from support.scripted import CharCodec, ScriptedEngine, ScriptedStep
from megatron_arpo.tools.base import Tool, ToolExecutor, ToolResult

CODEC = CharCodec()
RESULT = CODEC.token_id("<result>")
V98 = 98  # |V| of the reference harness (docs/design/arpo_reference.md §11.7)


def table(probs):
    return {1000 + i: math.log(p) for i, p in enumerate(probs)}


class Counter:
    def __init__(self):
        self.value = 0

    def next(self):
        self.value += 1
        return self.value


def traj_of(request) -> str:
    """The trajectory id in a scheduler request id (``<call>:<traj id>:s<segment>.<part>``)."""
    return request.request_id.split(":")[1]


def reference_script(rounds_with_search: int = 2, dists=((0.9, 0.1), (0.5, 0.5), (1.0,)),
                     counter: Optional[Counter] = None, per_trajectory_queries: bool = False):
    """§11.7: with r results in the context, round r < rounds_with_search searches, later rounds answer.

    Every segment carries a unique generation id g# and 20 filler characters, so the first 20 positions
    are all inside the segment (entropy 1.4180 / 3.0236 / 0 at |V| = 98 for the three rounds).
    ``per_trajectory_queries``: the query is ``q0.<r>@<trajectory id>`` (so a tool latency can be set per
    trajectory) instead of the reference's ``q0.<r>``.
    """
    counter = counter or Counter()

    def script(context, request):
        r = context.count(RESULT)
        g = counter.next()
        if r < rounds_with_search:
            query = f"q0.{r}@{traj_of(request)}" if per_trajectory_queries else f"q0.{r}"
            text = f"<think>g{g}:{'x' * 20}</think><search>{query}</search>"
        else:
            text = f"<think>g{g}:{'x' * 20}</think><answer>\\boxed{{x}}</answer><EOS>"
        return ScriptedStep(CODEC.encode(text), table(dists[min(r, len(dists) - 1)]))

    return script


class ScriptedSearch(Tool):
    """A real Tool whose latency is a function of the query; logs start/finish events."""

    tag = "search"

    def __init__(self, latency: Callable[[str], float] = lambda q: 0.0, log: Optional[list] = None):
        self.latency = latency
        self.log = log

    async def execute(self, query: str) -> ToolResult:
        if self.log is not None:
            self.log.append(("tool_start", query))
        await asyncio.sleep(self.latency(query))
        if self.log is not None:
            self.log.append(("tool_finish", query))
        return ToolResult(text=f"doc[{query}]")


class ScriptedRng:
    """U streams looked up by the trajectory id (the last spawn key); records every draw in order."""

    def __init__(self, table: dict, key: str = "", used: Optional[list] = None):
        self.table = table
        self.key = key
        self.used = used if used is not None else []

    def spawn(self, key):
        return ScriptedRng(self.table, str(key), self.used)

    def draw(self):
        u = self.table[self.key].pop(0)
        self.used.append((self.key, u))
        return u


def make_scheduler(script, *, tool_latency=lambda q: 0.0, engine_latency=0.0, num_engines=1, log=None,
                   rng=None, vocab_size=V98, **options):
    engines = [ScriptedEngine(script, engine_index=i, latency_s=engine_latency, event_log=log)
               for i in range(num_engines)]
    executor = ToolExecutor([ScriptedSearch(tool_latency, log)], timeout_s=10, retries=0)
    protocol = TagProtocol(CODEC, ["search", "python"], vocab_size=vocab_size)
    scheduler = RolloutScheduler(RolloutGroup(engines), executor, protocol, RolloutOptions(**options), rng=rng)
    return scheduler, engines


def text_of(ids):
    return CODEC.decode(ids)


def check_masks(traj):
    """Loss mask is 0 exactly on spliced result tokens and 1 everywhere else."""
    traj.check()
    tool_positions = set()
    for call in traj.tool_calls:
        span = range(call.result_offset, call.result_offset + call.num_result_tokens)
        tool_positions.update(span)
        block = text_of(traj.response_ids[call.result_offset:call.result_offset + call.num_result_tokens])
        full = f" <result>\n{call.result_text}\n</result>"
        assert full.startswith(block) and block, (block, full)
    for pos, m in enumerate(traj.loss_mask):
        assert m == (0 if pos in tool_positions else 1), (traj.traj_id, pos)


H_R0 = 20 * -(0.9 * math.log(0.9) + 0.1 * math.log(0.1)) / math.log(V98)   # 1.4180
H_R1 = 20 * math.log(2) / math.log(V98)                                     # 3.0236
PROMPT = CODEC.encode("Q0")


def run(scheduler, prompts, **kwargs):
    return asyncio.run(scheduler.run(prompts, **kwargs))


def gen_ids(traj):
    """The g# generation id of every segment of a trajectory, in order."""
    return [re.search(r"g(\d+):", text_of(traj.response_ids[s.start:s.start + s.num_tokens])).group(1)
            for s in traj.segments]


def result_end(traj, k):
    call = traj.tool_calls[k]
    return call.result_offset + call.num_result_tokens
