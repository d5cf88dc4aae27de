"""The progress reporter (a bar on a terminal, periodic lines in files), ANSI stripping on the way into log
files, and the filter for vLLM's per-sync rotary warning."""

from __future__ import annotations

import inspect
import io
import logging

import pytest

from launchers.local import _pump
from megatron_arpo.demo import relay_stage_output
from megatron_arpo.progress import LOGGER_NAME, Progress, format_duration, strip_ansi, strip_ansi_bytes
from megatron_arpo.tracking import progress
from megatron_arpo.weight_sync.vllm_plugin import RELOAD_LOGGER, install_vllm_log_filters


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER_NAME]


def test_file_output_gets_first_periodic_and_last_lines_with_eta(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    clock, out = Clock(), io.StringIO()
    report = Progress("sft", 10, rate_unit="tok", interval_s=30.0, stream=out, clock=clock)
    for step in range(1, 11):
        clock.now += 20.0 if step == 1 else 10.0  # a slow first step, then 10 s per step
        report.update(1, amount=5000.0)
    report.close()
    lines = _lines(caplog)
    # step 1 (first); 30 s later step 4; step 7; the last, step 10; close adds nothing after the last
    assert [line.split(" steps")[0] for line in lines] == ["sft: 1/10", "sft: 4/10", "sft: 7/10", "sft: 10/10"]
    assert lines[0] == "sft: 1/10 steps (10%) | 20 s/step | 250 tok/s | elapsed 20 s | ETA 3.0 min"
    # The window since the previous line: 3 steps in 30 s -> 10 s/step, 500 tok/s; 6 left -> ETA 60 s
    assert lines[1] == "sft: 4/10 steps (40%) | 10 s/step | 500 tok/s | elapsed 50 s | ETA 60 s"
    assert lines[-1].startswith("sft: 10/10 steps (100%) | 10 s/step") and lines[-1].endswith("ETA 0 s")
    assert out.getvalue() == ""  # no bar, no carriage return: the lines go through logging only


def test_resumed_run_counts_from_its_step_and_close_reports_the_tail(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    clock = Clock()
    report = Progress("train", 100, done=40, stream=io.StringIO(), clock=clock, interval_s=1e9)
    clock.now += 60.0
    report.update(1)
    clock.now += 2 * 60.0
    report.update(2)  # within the interval: no line
    assert report.eta_s() == pytest.approx(57 * 60.0)  # first window: 60 s for 1 step, 57 left
    report.close()  # the two steps since the line are reported on close
    lines = _lines(caplog)
    assert len(lines) == 2 and lines[0].startswith("train: 41/100 steps (41%) | 60 s/step")
    assert lines[1].startswith("train: 43/100 steps (43%) | 60 s/step") and lines[1].endswith("ETA 57.0 min")


def test_unknown_total_has_no_eta_and_durations_read_well(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    clock = Clock()
    report = Progress("eval x", None, unit="sample", stream=io.StringIO(), clock=clock)
    clock.now += 4.0
    report.update(2)
    assert _lines(caplog) == ["eval x: 2 samples | 2 s/sample | elapsed 4 s"]
    assert (format_duration(42), format_duration(600), format_duration(9000)) == ("42 s", "10.0 min", "2.5 h")


def test_terminal_gets_a_bar_and_one_closing_line(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    clock, term = Clock(), Terminal()
    report = Progress("eval gaia", 5, unit="sample", rate_unit="tok", stream=term, clock=clock, interval_s=0.0)
    for _ in range(5):
        clock.now += 3.0
        report.update(1, amount=300.0)
    report.close()
    assert "\r" in term.getvalue() and "eval gaia" in term.getvalue()  # tqdm drew the bar there
    lines = _lines(caplog)
    assert lines == ["eval gaia: 5/5 samples (100%) | 3 s/sample | 100 tok/s | elapsed 15 s | ETA 0 s"]


def test_phase_bar_is_drawn_on_a_terminal_only(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    with progress("step 1/3", None) as bar:
        bar.set_postfix_str("rollout")
        bar.update(1)
    assert type(bar).__name__ == "_Null"  # a log file gets no bar fragments
    term = Terminal()
    monkeypatch.setattr("sys.stderr", term)
    with progress("step 1/3", None) as bar:
        bar.update(1)
    assert type(bar).__name__ == "tqdm" and "step 1/3" in term.getvalue()


RAY_LINE = "\x1b[36m(MegatronWorker pid=4242)\x1b[0m \x1b[1;33mWARNING\x1b[0m loss 0.5\x1b]8;;http://x\x07link\x1b]8;;\x07\n"


def test_strip_ansi_removes_colours_cursor_moves_and_hyperlinks():
    assert strip_ansi(RAY_LINE) == "(MegatronWorker pid=4242) WARNING loss 0.5link\n"
    assert strip_ansi("\x1b[2K\x1b[1Gdone\x1b(B") == "done"
    assert strip_ansi_bytes(RAY_LINE.encode()) == b"(MegatronWorker pid=4242) WARNING loss 0.5link\n"
    assert strip_ansi("plain [36m text") == "plain [36m text"  # no escape byte, nothing removed


def test_local_launcher_log_file_gets_no_ansi_codes_the_terminal_keeps_them():
    class TerminalBytes(io.BytesIO):
        def isatty(self) -> bool:
            return True

    log, term = io.BytesIO(), TerminalBytes()
    _pump(io.BytesIO(RAY_LINE.encode() * 2), [term, log])
    assert b"\x1b" not in log.getvalue() and log.getvalue().count(b"(MegatronWorker pid=4242) WARNING") == 2
    assert term.getvalue() == RAY_LINE.encode() * 2


def test_demo_stage_log_is_clean_and_progress_lines_reach_the_console(caplog):
    caplog.set_level(logging.INFO, logger="megatron_arpo.demo")
    out = [
        "12:00:01 I megatron_arpo.sft: SFT: 64 conversations\n",
        "Loading: 10%|#         | 1/10\rLoading: 100%|##########| 10/10\n",
        "(EngineCore pid=29522) INFO [ompmultiprocessing.py:185] OpenMP thread binding info: \r\n",
        f"12:00:31 I {LOGGER_NAME}: sft: 4/40 steps (10%) | 7.5 s/step | 900 tok/s | elapsed 30 s | ETA 4.5 min\n",
        RAY_LINE,
    ]
    log = io.StringIO()
    relay_stage_output(out, log, "sft")
    text = log.getvalue()
    assert "\x1b" not in text and "\r" not in text
    assert text.splitlines()[1] == "Loading: 100%|##########| 10/10"  # the last state of the redrawn bar
    assert text.splitlines()[2].endswith("binding info: ")  # a CRLF line keeps its text
    console = [r.getMessage() for r in caplog.records if r.name == "megatron_arpo.demo"]
    assert console == ["[sft] sft: 4/40 steps (10%) | 7.5 s/step | 900 tok/s | elapsed 30 s | ETA 4.5 min"]


def test_rotary_reload_warning_is_filtered_other_layers_still_warn():
    install_vllm_log_filters()
    install_vllm_log_filters()  # idempotent: vLLM loads plugins more than once per process
    reload_logger = logging.getLogger(RELOAD_LOGGER)
    assert len(reload_logger.filters) == 1
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler = Keep()
    reload_logger.addHandler(handler)
    try:
        # The call exactly as vLLM makes it (vllm/model_executor/model_loader/reload/layerwise.py).
        for name in ("RotaryEmbedding", "Llama3RotaryEmbedding", "QKVParallelLinear"):
            reload_logger.warning("%s: Failed to load weights", name)
        reload_logger.warning("RotaryEmbedding: something else")
    finally:
        reload_logger.removeHandler(handler)
    assert seen == ["QKVParallelLinear: Failed to load weights", "RotaryEmbedding: something else"]


def test_the_filter_targets_vllms_logger_and_message():
    layerwise = pytest.importorskip("vllm.model_executor.model_loader.reload.layerwise")
    assert layerwise.logger.name == RELOAD_LOGGER
    assert 'logger.warning("%s: Failed to load weights", layer.__class__.__name__)' in inspect.getsource(layerwise)
    from vllm.model_executor.layers.rotary_embedding import base

    # The rotary layer's only tensors are its cos/sin cache buffers, computed at construction from the rope
    # settings (the reason the warning is harmless: nothing trained is in them, and vLLM puts them back).
    source = inspect.getsource(base.RotaryEmbeddingBase)
    assert 'self.register_buffer("cos_sin_cache", cache, persistent=False)' in source
    assert "Parameter(" not in source


def test_evaluation_reports_progress_per_dataset(tmp_path, caplog):
    import asyncio
    from pathlib import Path

    from evaluation.datasets import parse_dataset_names
    from evaluation.runner import EvalSettings, Generation, run_evaluation

    class Answer42:
        async def generate(self, sample, run, messages):
            return Generation(trajectory={}, response_text="<answer>\\boxed{42}</answer>", finish_reason="stop",
                              num_response_tokens=12, tool_calls=[])

    mini = Path(__file__).resolve().parents[2] / "evaluation" / "data" / "mini"
    settings = EvalSettings(model="m", datasets=parse_dataset_names("gsm8k"), data_dir=str(mini),
                            out_dir=tmp_path / "out", k=1, temperature=0.0, max_samples=3)
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    asyncio.run(run_evaluation(settings, Answer42()))
    lines = _lines(caplog)
    assert lines[0].startswith("eval gsm8k: 1/3 samples (33%) |") and "tok/s" in lines[0]
    assert lines[-1].startswith("eval gsm8k: 3/3 samples (100%) |") and lines[-1].endswith("ETA 0 s")
