"""Resume decisions and the driver state of a checkpoint (megatron_arpo.trainer.checkpointing)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_arpo.data.sampler import EpochSampler
from megatron_arpo.tools.base import ToolResult
from megatron_arpo.tools.cache import ToolCache
from megatron_arpo.trainer import checkpointing
from megatron_arpo.trainer.checkpointing import ResumeError, is_due, resolve_resume


def make_ckpt(root: Path, step: int, complete: bool = True) -> Path:
    """A step-N directory whose model/ is a real (tiny) torch distributed checkpoint."""
    import torch
    import torch.distributed.checkpoint as dcp

    path = root / f"step-{step}"
    path.mkdir(parents=True)
    dcp.save({"w": torch.arange(64, dtype=torch.float32), "b": torch.ones(8)}, checkpoint_id=str(path / "model"))
    if complete:
        (path / "COMPLETE").write_text(f"{step}\n")
    return path


def test_resume_auto_takes_the_newest_complete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    assert resolve_resume(root, "auto") is None  # nothing yet: fresh start
    make_ckpt(root, 2)
    make_ckpt(root, 10)
    make_ckpt(root, 12, complete=False)  # a save killed half way
    assert resolve_resume(root, "auto") == root / "step-10"


def test_resume_none_refuses_to_overwrite_a_run(tmp_path):
    root = tmp_path / "checkpoints"
    assert resolve_resume(root, "none") is None
    make_ckpt(root, 3)
    with pytest.raises(ResumeError, match="--resume auto"):
        resolve_resume(root, "none")


def test_resume_path(tmp_path):
    root = tmp_path / "checkpoints"
    make_ckpt(root, 4)
    assert resolve_resume(tmp_path / "elsewhere", str(root / "step-4")) == (root / "step-4").resolve()
    assert resolve_resume(tmp_path / "elsewhere", str(root)) == (root / "step-4").resolve()
    make_ckpt(root, 5, complete=False)
    with pytest.raises(ResumeError, match="no complete checkpoint"):
        resolve_resume(tmp_path / "elsewhere", str(root / "step-5"))


def test_resume_refuses_a_damaged_checkpoint_before_any_rank_loads_it(tmp_path):
    root = tmp_path / "checkpoints"
    path = make_ckpt(root, 6)
    shard = next((path / "model").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])  # a copy cut short
    with pytest.raises(ResumeError) as info:
        resolve_resume(root, "auto")
    message = str(info.value)
    assert f"{shard}: truncated ({len(data) // 2} bytes; the metadata needs" in message
    assert "Resume from an earlier checkpoint" in message and isinstance(info.value, ValueError)
    shard.unlink()
    with pytest.raises(ResumeError, match=f"{shard}: missing"):
        resolve_resume(root, str(path))
    (path / "model" / ".metadata").write_bytes(b"\x80not a pickle")
    with pytest.raises(ResumeError, match=r"\.metadata: unreadable"):
        resolve_resume(root, str(path))


@pytest.mark.parametrize("step,every,total,due", [(5, 5, 20, True), (4, 5, 20, False), (20, 5, 20, True),
                                                   (3, 0, 20, False), (20, 0, 20, True), (7, 1, 20, True)])
def test_is_due(step, every, total, due):
    assert is_due(step, every, total) is due


def test_driver_state_round_trip_restores_sampler_step_and_tool_cache(tmp_path):
    import asyncio

    def runtime(cache_path):
        cfg = SimpleNamespace(rollout=SimpleNamespace(seed=7))
        return SimpleNamespace(cfg=cfg, step=0, total_steps=10, last_saved_step=None, resume_from=None,
                               sampler=EpochSampler(5, 2, seed=3), tools=SimpleNamespace(cache=ToolCache(cache_path)))

    before = runtime(str(tmp_path / "live.sqlite"))
    before.sampler.next_batch()
    before.sampler.next_batch()
    before.step = 2
    asyncio.run(before.tools.cache.get_or_compute("search", "q", lambda: _result("answer")))
    state = checkpointing.driver_state(before)
    assert state["step"] == 2 and state["sampler"]["position"] == 4 and state["tool_cache"] == "tool_cache.sqlite"
    ckpt = tmp_path / "step-2"
    ckpt.mkdir()
    before.tools.cache.export(str(ckpt / state["tool_cache"]))

    after = runtime(str(tmp_path / "other.sqlite"))  # the live cache file was lost
    after.resume_from = ckpt
    checkpointing.restore_driver_state(after, state)
    assert after.step == after.last_saved_step == 2
    assert after.sampler.next_batch() == before.sampler.next_batch()  # the very next prompts, across the epoch end
    assert after.tools.cache.get("search", "q").text == "answer"


def test_the_live_tool_cache_is_under_the_run_dir_unless_a_path_is_set(tmp_path, monkeypatch):
    """By default the live cache lives in a directory of the run's own, never under a predictable name in a
    shared /tmp; the checkpoint snapshot carries it between nodes."""
    from megatron_arpo.config import load_config

    monkeypatch.setenv("TMPDIR", str(tmp_path / "node-local"))
    demo = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    a = load_config(demo, [f"trainer.run_dir={tmp_path / 'shared' / 'a'}"])
    b = load_config(demo, [f"trainer.run_dir={tmp_path / 'shared' / 'b'}"])
    path_a = Path(checkpointing.tool_cache_path(a))
    assert path_a == tmp_path / "shared" / "a" / "tool_cache" / "tool_cache.sqlite"
    assert path_a == Path(checkpointing.tool_cache_path(a))  # a restart finds it again
    assert path_a != Path(checkpointing.tool_cache_path(b))  # two runs never share one
    pinned = a.with_overrides([f"tools.cache.path={tmp_path / 'mine.sqlite'}"])
    assert checkpointing.tool_cache_path(pinned) == str(tmp_path / "mine.sqlite")
    assert checkpointing.tool_cache_path(a.with_overrides(["tools.cache=null"])) is None


def test_restore_rejects_a_checkpoint_without_sampler_state(tmp_path):
    rt = SimpleNamespace(resume_from=tmp_path, cfg=None)
    with pytest.raises(ResumeError, match="no sampler state"):
        checkpointing.restore_driver_state(rt, {"step": 3, "stage": "sft"})


async def _result(text):
    return ToolResult(text=text)
