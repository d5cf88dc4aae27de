"""Pre-flight at submit: `launch slurm` / `launch local` refuse a job that would fail after the queue wait.

A stub ``sbatch`` on PATH records that it was called and prints a job id. A job with a missing checkpoint,
missing data or an unreachable retriever exits 2 before ``sbatch`` runs, naming each problem; a job with
everything in place (the tiny checkpoint, a data file, a retriever answering on localhost, the python
tool's real sandbox) is submitted, and the launcher prints how to follow and cancel it.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from launchers.cli import job_of
from megatron_arpo import cli
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

STUB_SBATCH = """#!/bin/sh
echo "$@" >> "{calls}"
echo 123456
"""


class Retriever:
    """A FlashRAG-style retriever on localhost that answers every query with one passage."""

    def __init__(self):
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = json.dumps({"result": [[{"document": {"contents": '"Paris"\nthe capital'}, "score": 1.0}]]})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/retrieve"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/retrieve"  # nothing listens there any more


@pytest.fixture
def retriever():
    server = Retriever()
    yield server
    server.close()


@pytest.fixture
def sbatch_calls(tmp_path, monkeypatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "sbatch-calls.txt"
    stub = bin_dir / "sbatch"
    stub.write_text(STUB_SBATCH.format(calls=calls))
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    return calls


def write_config(d: Path, *, checkpoint: str | None = None, data: bool = True, url: str = "",
                 model: str = "tiny-qwen3") -> str:
    qa = d / "qa.jsonl"
    if data:
        qa.write_text(json.dumps({"question": "Capital of France?", "answer": "Paris"}) + "\n")
    cfg = {"name": "pf", "model": {"config": model, "hf_checkpoint": checkpoint or str(tiny_checkpoint("tiny-qwen3"))},
           "rollout": {"response_length": 256}, "trainer": {"run_dir": str(d / "run")},
           "tools": {"search": {"enabled": True, "backend": "http", "url": url}},
           "launcher": {"gpus_per_node": 0, "nodes": 1}, "data": {"train_files": [str(qa)]}}
    path = d / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def submit(config: str, *extra: str) -> list[str]:
    return ["launch", "slurm", "--config", config, "--partition", "P", *extra]


@pytest.mark.parametrize("missing", ["checkpoint", "data", "retriever", "all three"])
def test_launch_slurm_refuses_before_sbatch_naming_each_problem(missing, tmp_path, sbatch_calls, retriever, capsys):
    all_three = missing == "all three"
    config = write_config(tmp_path, checkpoint=str(tmp_path / "no-ckpt") if missing == "checkpoint" or all_three else None,
                          data=not (missing == "data" or all_three),
                          url=closed_port_url() if missing == "retriever" or all_three else retriever.url)
    assert cli.main(submit(config)) == 2
    err = capsys.readouterr().err
    assert not sbatch_calls.exists(), "sbatch ran although the pre-flight found problems"
    assert not (tmp_path / "run" / "config.yaml").exists()
    named = {"checkpoint": f"model.hf_checkpoint: dir '{tmp_path}/no-ckpt' not found",
             "data": f"data.train_files[0]: file '{tmp_path}/qa.jsonl' not found",
             "retriever": "tools.search.url: the retriever did not answer a test query"}
    for key, text in named.items():
        assert (text in err) == (key == missing or all_three), (key, err)
    assert err.startswith("megatron-arpo launch slurm: error: ")
    problems = [line for line in err.splitlines()[1:] if line.strip() and not line.strip().startswith("(")]
    assert len(problems) == (3 if all_three else 1), err  # one line per problem
    assert "Traceback" not in err


def test_launch_slurm_submits_when_everything_is_in_place(tmp_path, sbatch_calls, retriever, capsys):
    config = write_config(tmp_path, url=retriever.url)
    assert cli.main(submit(config)) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert sbatch_calls.read_text().startswith("--parsable ")
    assert "submitted job 123456" in out
    assert f"tail -F {tmp_path}/run/logs/megatron-arpo-123456-node0.out" in out
    assert "squeue -j 123456" in out and "cancel: scancel 123456" in out


def test_no_preflight_submits_anyway(tmp_path, sbatch_calls, capsys):
    config = write_config(tmp_path, checkpoint=str(tmp_path / "no-ckpt"), data=False, url=closed_port_url())
    assert cli.main(submit(config, "--no-preflight")) == 0, capsys.readouterr().err
    assert sbatch_calls.exists()


def test_launch_local_refuses_before_starting_ray(tmp_path, capsys):
    config = write_config(tmp_path, checkpoint=str(tmp_path / "no-ckpt"), url=closed_port_url())
    assert cli.main(["launch", "local", "--config", config]) == 2
    err = capsys.readouterr().err
    assert "model.hf_checkpoint: dir" in err and "tools.search.url: the retriever did not answer" in err
    assert not (tmp_path / "run").exists()  # nothing written, no Ray node started


def test_a_2_layer_checkpoint_against_qwen3_32b_names_every_differing_field(tmp_path, capsys):
    config = write_config(tmp_path, model="qwen3-32b")
    assert cli.main(["config", "validate", "--config", config, "--paths", "train", "--set", "tools.search.enabled=false"]) == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "model.hf_checkpoint" in line)
    for field, ckpt, ours in (("num_hidden_layers", 2, 64), ("hidden_size", 256, 5120), ("num_attention_heads", 4, 64),
                              ("num_key_value_heads", 2, 8), ("head_dim", 64, 128), ("intermediate_size", 512, 25600),
                              ("vocab_size", 1000, 151936), ("tie_word_embeddings", True, False)):
        assert f"{field} {ckpt} (model.config: {ours})" in line, (field, line)
    assert "disagrees with model.config 'qwen3-32b' on 9 field(s)" in line
    assert "set model.config: tiny-qwen3" in line  # the shipped config that matches the checkpoint


def test_train_refuses_the_mismatch_before_ray_starts(tmp_path, capsys):
    """`train` runs the checkpoint check before it starts anything (it surfaced 85 s in, inside the actor)."""
    config = write_config(tmp_path, model="tiny-qwen3-untied")
    assert cli.main(["train", "--config", config, "--set", "tools.search.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert "tie_word_embeddings True (model.config: False)" in err
    assert not (tmp_path / "run").exists()


def test_the_job_command_decides_which_checks_run():
    assert job_of(["megatron-arpo", "sft", "--config", "x"]) == "sft"
    assert job_of(["/usr/bin/python3", "-m", "megatron_arpo", "train", "--config", "x"]) == "train"
    assert job_of(["/venv/bin/megatron-arpo", "eval", "--hf", "x"]) == "eval"
    assert job_of(["python", "my_job.py", "train"]) is None
