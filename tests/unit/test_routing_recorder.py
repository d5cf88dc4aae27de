"""`RoutingRecorder`'s bookkeeping on a stand-in V1 model runner: rows by position, cached prefixes, ids.

The runner here does what vLLM's V1 runner does around ``_model_forward``: a batch of requests, each with
``num_computed_tokens`` and a slice of the flattened step, and a capture buffer the routers write during the
forward. Its router sends a token to experts that depend on the token and the layer, so the rows of a prefix
served from the cache are known. The real engine is tests/integration/test_moe_engine.py; the GPU branch (CUDA buffers, the copy to the host
without blocking) runs in tests/fakecuda/test_routing_recorder_gpu.py on this stand-in.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_arpo.rollout.routing_recorder import (CAPTURE_CONFIG_KEY, CAPTURER_ATTR, RoutingRecorder,
                                                    capture_requested, decode_rows, install_load_hook)

LAYERS, TOPK, EXPERTS, BLOCK = 2, 2, 8, 4


def experts_of(token: int, layer: int) -> list[int]:
    return [(token + layer) % EXPERTS, (token + layer + 3) % EXPERTS]


class StandInRunner:
    """The parts of vLLM's V1 runner the recorder reads, and a forward that routes."""

    def __init__(self, num_blocks: int = 64, device: str = "cpu"):
        self.vllm_config = SimpleNamespace(
            cache_config=SimpleNamespace(block_size=BLOCK, num_gpu_blocks=num_blocks),
            compilation_config=SimpleNamespace(mode=0),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=256))
        self.capturer = SimpleNamespace(device_buffer=torch.zeros(256, LAYERS, TOPK, dtype=torch.int32, device=device),
                                        shape_per_token=(LAYERS, TOPK))
        self.input_batch = SimpleNamespace(num_reqs=0, req_ids=[], num_computed_tokens_cpu=np.zeros(8, np.int32),
                                           token_ids_cpu=np.zeros((8, 512), np.int32))
        self.query_start_loc = SimpleNamespace(np=np.zeros(9, np.int32))
        self.buffer = torch.zeros(256, dtype=torch.int32, device=device)   # the runner's input ids, reused
        self.recorder = RoutingRecorder(self, capturer=self.capturer)

    def _model_forward(self, input_ids=None, positions=None, **_):
        for i, tok in enumerate(input_ids.tolist()):
            for layer in range(LAYERS):
                self.capturer.device_buffer[i, layer] = torch.tensor(experts_of(tok, layer), device=self.buffer.device)
        return None

    def step(self, scheduled: list[tuple[str, list[int], int, int]]) -> None:
        """``(request id, its whole token list so far, first position computed, tokens computed)`` each."""
        batch = self.input_batch
        batch.num_reqs, batch.req_ids = len(scheduled), [rid for rid, *_ in scheduled]
        flat, bounds = [], [0]
        for i, (_, tokens, start, n) in enumerate(scheduled):
            batch.num_computed_tokens_cpu[i] = start
            batch.token_ids_cpu[i, :len(tokens)] = tokens
            flat += tokens[start:start + n]
            bounds.append(len(flat))
        self.query_start_loc.np[:len(bounds)] = bounds
        self.buffer[:len(flat)] = torch.tensor(flat, device=self.buffer.device)
        self._model_forward(input_ids=self.buffer[:len(flat)])


def expected(tokens: list[int]) -> np.ndarray:
    return np.array([[experts_of(t, layer) for layer in range(LAYERS)] for t in tokens])


def test_rows_by_position_with_a_prefix_served_from_the_cache_in_the_same_step():
    runner = StandInRunner()
    prompt = list(range(10, 20))                   # 10 tokens: two full blocks of 4
    a, b = prompt + [50, 51, 52], prompt + [60, 61]
    # step 1: a computes its prompt; b hits a's two full blocks in the same step and computes the rest
    runner.step([("a-1234abcd", a, 0, 10), ("b-99999999", b, 8, 2)])
    for k in range(2):                             # decode: each step feeds the token sampled before it
        runner.step([("a-1234abcd", a, 10 + k, 1), ("b-99999999", b, 10 + k, 1)])
    runner.step([("a-1234abcd", a, 12, 1)])        # a's last generated token is never fed
    got = runner.recorder.take(["a", "b"])
    rows_a, rows_b = decode_rows(got["a"]), decode_rows(got["b"])
    np.testing.assert_array_equal(rows_a, expected(a))
    np.testing.assert_array_equal(rows_b, expected(b[:12]))  # through the last token a forward saw
    assert runner.recorder.stats["filled_from_store"] == 2 * BLOCK
    assert runner.recorder.requests == {} and runner.recorder.take(["a"]) == {"a": None}


def test_the_next_step_overwriting_the_runner_buffers_does_not_reach_the_recorded_rows():
    runner = StandInRunner()
    runner.step([("x-00000000", [1, 2, 3, 4, 5], 0, 5)])
    runner.step([("y-00000000", [7, 7, 7, 7, 7], 0, 5)])   # same buffers, other tokens, before x's are filed
    runner.step([("z-00000000", [1, 2, 3, 4, 9], 4, 1)])    # x's first block, from the cache
    np.testing.assert_array_equal(decode_rows(runner.recorder.take(["x"])["x"]), expected([1, 2, 3, 4, 5]))
    np.testing.assert_array_equal(decode_rows(runner.recorder.take(["z"])["z"]), expected([1, 2, 3, 4, 9]))


def test_an_evicted_block_leaves_minus_one_rows_for_the_actor_to_route():
    runner = StandInRunner(num_blocks=1)           # the store keeps one block
    prompt = list(range(100, 108))                 # two blocks
    runner.step([("w-00000000", prompt, 0, 8)])
    runner.step([("r-00000000", prompt + [5], 8, 1)])     # both blocks served from the cache
    rows = decode_rows(runner.recorder.take(["r"])["r"])
    assert (rows[:BLOCK] == -1).all()              # the first block was evicted
    np.testing.assert_array_equal(rows[BLOCK:], expected(prompt[BLOCK:] + [5]))
    assert runner.recorder.stats["missing_blocks"] == 1


def test_a_recomputed_request_overwrites_its_rows_and_an_aborted_one_is_dropped():
    runner = StandInRunner()
    first, again = [1, 2, 3, 4, 5], [1, 2, 3, 4, 6]
    runner.step([("p-00000000", first, 0, 5)])
    runner.step([("p-00000000", again, 4, 1)])     # position 4 computed again with another token
    runner.step([("q-00000000", [9, 9], 0, 2)])
    runner.recorder.drop(["q"])
    assert set(runner.recorder.requests) == {"p-00000000"}
    np.testing.assert_array_equal(decode_rows(runner.recorder.take(["p"])["p"]), expected(again))


def test_a_compiled_engine_without_a_load_time_capturer_is_refused_with_the_fix():
    runner = StandInRunner()
    runner.vllm_config.compilation_config.mode = 2
    runner.get_model = lambda: torch.nn.Linear(1, 1)   # no capturer was bound when it loaded
    with pytest.raises(RuntimeError) as info:
        RoutingRecorder(runner)
    assert f"additional_config={{{CAPTURE_CONFIG_KEY!r}: True}}" in str(info.value)
    assert "pip install -e ." in str(info.value) and "enforce_eager" in str(info.value)


def test_a_compiled_engine_records_with_the_capturer_bound_at_load():
    runner = StandInRunner()
    runner.vllm_config.compilation_config.mode = 2
    model = torch.nn.Linear(1, 1)
    setattr(model, CAPTURER_ATTR, runner.capturer)     # what install_load_hook's loader leaves on the model
    runner.get_model = lambda: model
    assert RoutingRecorder(runner).capturer is runner.capturer


def test_the_load_hook_is_installed_once_and_binds_only_when_asked():
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    install_load_hook()
    hooked = BaseModelLoader.load_model
    install_load_hook()                                 # vLLM may load its plugins several times
    assert BaseModelLoader.load_model is hooked and hooked._megatron_arpo_capture
    assert not getattr(hooked.__wrapped__, "_megatron_arpo_capture", False)
    assert capture_requested(SimpleNamespace(additional_config={CAPTURE_CONFIG_KEY: True}))
    assert not capture_requested(SimpleNamespace(additional_config={}))
    assert not capture_requested(SimpleNamespace(additional_config=None))
