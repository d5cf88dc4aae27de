"""Bad input of every kind fails early through the real CLI: exit code 2, one message naming the key, the
file or the row (and the fix), and no traceback.

Each case builds its files in a fresh directory and runs ``megatron-arpo ...`` in this process
(``megatron_arpo.cli.main``, which is what the console script calls); a handful also run as a
subprocess to show the real entry point behaves the same. The ``train``/``sft`` cases fail before any
Ray or Megatron process starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

from megatron_arpo import cli

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Path], list[str]]  # builds the files under the dir, returns the CLI argv
    expect: tuple[str, ...]  # substrings of stderr (with "{d}" = the case's directory)
    root_only: bool = False


def _base(d: Path, **sections) -> dict:
    qa = d / "qa.jsonl"
    if not qa.exists():
        qa.write_text(json.dumps({"question": "Capital of France?", "answer": "Paris"}) + "\n")
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    # A real checkpoint: `config validate --paths` checks its config.json against model.config and its tokenizer.
    cfg = {"name": "bad", "model": {"config": "tiny-qwen3", "hf_checkpoint": str(tiny_checkpoint("tiny-qwen3"))}, "rollout": {"response_length": 256},
           "tools": {"search": {"enabled": False}}, "trainer": {"run_dir": str(d / "run")},
           "launcher": {"gpus_per_node": 0}, "data": {"train_files": [str(qa)]}}
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value}
    return cfg


def _write(d: Path, cfg: dict | str | bytes, name: str = "exp.yaml") -> str:
    path = d / name
    if isinstance(cfg, bytes):
        path.write_bytes(cfg)
    else:
        path.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg))
    return str(path)


def validate(cfg_or_text, *extra: str) -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        cfg = cfg_or_text(d) if callable(cfg_or_text) else cfg_or_text
        return ["config", "validate", "--config", _write(d, cfg), *extra]
    return make


def rows(name: str, lines: list, **sections) -> Callable[[Path], dict]:
    """A config whose training file ``name`` holds ``lines`` (JSON rows, or raw bytes)."""
    def make_cfg(d: Path) -> dict:
        path = d / name
        path.write_bytes(b"".join(x if isinstance(x, bytes) else (json.dumps(x) + "\n").encode() for x in lines))
        return _base(d, data={"train_files": [str(path)], **sections.get("data", {})})
    return make_cfg


def data_file(name: str, lines: list, **sections) -> Callable[[Path], list[str]]:
    """`config validate --paths train` of a config whose training file holds ``lines``."""
    return validate(rows(name, lines, **sections), "--paths", "train")


def sft_file(name: str, content: bytes, command: str = "validate") -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        (d / name).write_bytes(content)
        cfg = _base(d, sft={"train_files": [str(d / name)]})
        if command == "validate":
            return ["config", "validate", "--config", _write(d, cfg), "--paths", "sft"]
        from megatron_arpo.tiny.checkpoint import tiny_checkpoint

        cfg["model"]["hf_checkpoint"] = str(tiny_checkpoint("tiny-qwen3"))
        return ["sft", "--config", _write(d, cfg)]
    return make


def train(make_cfg: Callable[[Path], dict], *extra: str) -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        from megatron_arpo.tiny.checkpoint import tiny_checkpoint

        cfg = make_cfg(d)
        cfg["model"]["hf_checkpoint"] = str(tiny_checkpoint("tiny-qwen3"))
        return ["train", "--config", _write(d, cfg), *[x.format(d=d) for x in extra]]
    return make


def _truncated_checkpoint(d: Path) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    step = d / "run" / "checkpoints" / "step-3"
    dcp.save({"w": torch.arange(256, dtype=torch.float32)}, checkpoint_id=str(step / "model"))
    (step / "COMPLETE").write_text("3\n")
    shard = next((step / "model").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    return _base(d, trainer={"train_batch_size": 1}, actor={"mini_batch_size": 1})


def _search(**kw) -> Callable[[Path], dict]:
    return lambda d: _base(d, tools={"search": {"enabled": True, **kw}})


def _python(**kw) -> Callable[[Path], dict]:
    return lambda d: _base(d, tools={"python": kw})


GOOD = {"question": "q?", "answer": "a"}
SFT_ROW = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}

CASES = [
    # -- the config file itself
    Case("config path is a directory", lambda d: ["config", "validate", "--config", str(d)],
         ("config file", "is a directory; pass the YAML file inside it")),
    Case("config path missing", lambda d: ["config", "show", "--config", str(d / "nope.yaml")], ("nope.yaml' not found",)),
    Case("non-UTF-8 YAML", validate(b"name: x\nmodel: {config: tiny-qwen3}\n# caf\xe9\n"),
         ("exp.yaml: not UTF-8 text: byte 0xe9 on line 3",)),
    Case("duplicate key in a section",
         validate("model: {config: tiny-qwen3}\nactor:\n  optimizer:\n    lr: 1.0e-6\n    lr: 2.0e-6\n"),
         ("duplicate key 'lr' (first on line 4, again on line 5)", "exp.yaml")),
    Case("duplicate section", validate("model: {config: tiny-qwen3}\nrollout: {n: 4}\nrollout: {n: 8}\n"),
         ("duplicate key 'rollout' (first on line 2, again on line 3)",)),
    Case("YAML syntax error", validate("model: [unclosed\n"), ("exp.yaml: YAML syntax error", "line 2")),
    Case("top level is a list", validate("- model\n"), ("expected a mapping of sections at the top level",)),
    Case("lr: .inf", validate(lambda d: _base(d, actor={"optimizer": {"lr": float("inf")}})),
         ("actor.optimizer.lr: inf is not a finite number",)),
    Case("lr: .nan", validate(lambda d: _base(d, actor={"optimizer": {"lr": float("nan")}})),
         ("actor.optimizer.lr: nan is not a finite number",)),
    Case("--set lr=inf", lambda d: ["config", "validate", "--config", _write(d, _base(d)), "--set",
                                    "actor.optimizer.lr=inf"], ("actor.optimizer.lr: expected a number, got 'inf'",)),
    Case("rollout.n: 1e30", validate("model: {config: tiny-qwen3}\nrollout: {n: 1e30}\n"),
         ("rollout.n: '1e30' is not a usable integer",)),
    Case("--set rollout.n=1e30", lambda d: ["config", "validate", "--config", _write(d, _base(d)), "--set",
                                            "rollout.n=1e30"], ("rollout.n: '1e30' is not a usable integer",)),
    Case("rollout.n above its range", validate(lambda d: _base(d, rollout={"n": 5000, "response_length": 256})),
         ("rollout.n: 5000 is out of range; allowed: >= 1 and <= 4096",)),
    Case("misspelt key", validate(lambda d: _base(d, rollout={"beem_size": 2, "response_length": 256})),
         ("rollout.beem_size: unknown key (did you mean 'rollout.beam_size'?)",)),
    Case("a removed key", validate(lambda d: _base(d, actor={"checkpoint": {"async_save": True}})),
         ("actor.checkpoint.async_save: removed: saves are synchronous",)),
    Case("--set without =", lambda d: ["config", "validate", "--config", _write(d, _base(d)), "--set", "rollout.n"],
         ("override 'rollout.n': expected KEY=VALUE",)),
    Case("base: include cycle", lambda d: ["config", "validate", "--config",
                                           _write(d, "base: exp.yaml\nmodel: {config: tiny-qwen3}\n")],
         ("base: include cycle",)),
    Case("shared node without a CPU count", validate(lambda d: _base(d, launcher={"exclusive": False})),
         ("launcher.cpus_per_task: null means every CPU of the node",)),
    Case("memory that is no Slurm size", validate(lambda d: _base(d, launcher={"memory_per_node": "lots"})),
         ("launcher.memory_per_node: got 'lots'",)),
    Case("port range backwards", validate(lambda d: _base(d, launcher={"ray_port_range": "32000-20000"})),
         ("launcher.ray_port_range: '32000-20000' must satisfy 1024 <= LO < HI <= 65535",)),
    Case("judge URL ftp://", validate(lambda d: _base(d, eval={"judge": {"url": "ftp://judge.example/v1"}})),
         ("eval.judge.url: 'ftp://judge.example/v1' must start with http:// or https://",)),
    # -- what `train` refuses on this machine: `config validate` refuses it too
    Case("retriever URL ftp://", validate(_search(backend="http", url="ftp://retriever:8000/retrieve")),
         ("tools.search: search: retriever url 'ftp://retriever:8000/retrieve' must start with http://",)),
    Case("web search key unset", validate(_search(backend="web", api_key_env="MA_TEST_UNSET_KEY")),
         ("tools.search:", "environment variable MA_TEST_UNSET_KEY; export it",)),
    Case("sandbox user is root", validate(_python(user="root")), ("tools.python: python sandbox: user 'root' is root",),
         root_only=True),
    Case("sandbox user missing", validate(_python(user="no_such_user_x")),
         ("tools.python: python sandbox: user 'no_such_user_x' does not exist",), root_only=True),
    Case("sandbox interpreter missing", validate(_python(python_executable="/nonexistent/bin/python3")),
         ("tools.python: python sandbox: interpreter /nonexistent/bin/python3 does not exist",)),
    Case("local corpus missing", lambda d: ["config", "validate", "--config",
                                            _write(d, _search(corpus=str(d / "corpus.jsonl"))(d)), "--paths", "train"],
         ("tools.search.corpus: file", "corpus.jsonl' not found")),
    # -- dataset rows: refused at load, naming file and row
    Case("answer is []", data_file("qa.jsonl", [GOOD, {"question": "q?", "answer": []}]),
         ("qa.jsonl row 2: 'answer' is [] (list)", "data.on_bad_row: skip")),
    Case("answer is {}", data_file("qa.jsonl", [{"question": "q?", "answer": {}}]), ("qa.jsonl row 1: 'answer' is {} (dict)",)),
    # Numbers are answers (written as strings, as evaluation reads them); a mapping is not.
    Case("answer list holds a mapping", data_file("qa.jsonl", [GOOD, GOOD, {"question": "q?", "answer": ["a", {}]}]),
         ("qa.jsonl row 3: 'answer' is [\"a\", {}] (list)", "non-empty string, number or a non-empty list")),
    Case("non-UTF-8 JSONL row", data_file("qa.jsonl", [GOOD, b'{"question": "caf\xff?", "answer": "x"}\n']),
         ("qa.jsonl row 2: not UTF-8 text (byte 0xff at column 18)",)),
    Case("invalid JSON row", data_file("qa.jsonl", [GOOD, b"{not json\n"]), ("qa.jsonl row 2: invalid JSON",)),
    Case("parquet that is not parquet", data_file("x.parquet", [b"PAR1 nope"]), ("x.parquet: not a readable parquet file",)),
    Case("train file missing", validate(lambda d: _base(d, data={"train_files": [str(d / "gone.jsonl")]}), "--paths", "train"),
         ("data.train_files[0]: file", "gone.jsonl' not found")),
    Case("train file is a directory", validate(lambda d: _base(d, data={"train_files": [str(d)]}), "--paths", "train"),
         ("data.train_files[0]:", "is a directory; give the file")),
    # -- SFT data
    Case("SFT row is not JSON", sft_file("sft.jsonl", (json.dumps(SFT_ROW) + "\n{oops\n").encode()),
         ("sft.jsonl:2: invalid JSON",)),
    Case("SFT unknown role", sft_file("sft.jsonl", json.dumps({"conversations": [{"from": "robot", "value": "x"}]}).encode()),
         ("sft.jsonl:1: turn 0 has role 'robot'",)),
    Case("SFT non-UTF-8 row", sft_file("sft.jsonl", json.dumps(SFT_ROW).encode() + b"\n\xc3\x28\n"),
         ("sft.jsonl:2: not UTF-8 text (byte 0xc3 at column 1)",)),
    Case("SFT file of the wrong kind", sft_file("sft.txt", b"hello"), ("sft.txt: cannot tell the format from the suffix '.txt'", "name the file .parquet / .jsonl")),
    Case("sft command with a bad row", sft_file("sft.jsonl", (json.dumps(SFT_ROW) + "\n[1, 2]\n").encode(), "sft"),
         ("sft.jsonl:2: expected an object with 'conversations', got list",)),
    # -- the train command: input errors are exit 2, not 1
    Case("train with an answer of []", train(rows("qa.jsonl", [{"question": "q?", "answer": []}])),
         ("qa.jsonl row 1: 'answer' is [] (list)",)),
    Case("train with a missing sandbox user", train(_python(user="no_such_user_x")),
         ("tools.python: python sandbox: user 'no_such_user_x' does not exist",), root_only=True),
    Case("train resuming a truncated shard", train(_truncated_checkpoint, "--resume", "auto"),
         ("checkpoint {d}/run/checkpoints/step-3 is damaged", "__0_0.distcp: truncated (100 bytes",
          "Resume from an earlier checkpoint")),
    Case("train resuming nothing", train(lambda d: _base(d, trainer={"train_batch_size": 1},
                                                         actor={"mini_batch_size": 1}), "--resume", "{d}/nowhere"),
         ("--resume {d}/nowhere: no complete checkpoint there",)),
    Case("train batch larger than the data", train(lambda d: _base(d, trainer={"train_batch_size": 4},
                                                                   actor={"mini_batch_size": 4})),
         ("trainer.train_batch_size: 4 exceeds the 1 training prompts",)),
    # -- launching
    Case("launch slurm with a directory", lambda d: ["launch", "slurm", "--config", str(d), "--dry-run"],
         ("is a directory",)),
    Case("launch slurm with 0 nodes", lambda d: ["launch", "slurm", "--config", _write(d, _base(d)), "--nodes", "0",
                                                 "--dry-run"], ("launcher.nodes: got 0; allowed: an integer >= 1",)),
    Case("plan of a non-UTF-8 config", lambda d: ["plan", "--config", _write(d, b"model: qwq-32b # \xff\n")],
         ("not UTF-8 text: byte 0xff on line 1",)),
]


def _evil_pickle(marker: Path, torch_name_first: bool = False) -> bytes:
    """A pickle that runs ``touch marker`` when loaded unrestricted, optionally naming a torch class first."""
    head = b"ctorch\nnn\n0" if torch_name_first else b""
    return head + b"cposix\nsystem\n(Vtouch " + str(marker).encode() + b"\ntR."


def _crafted_checkpoint(what: str, torch_name_first: bool = False) -> Callable[[Path], dict]:
    """A training checkpoint ``step-3`` whose model ``.metadata`` (or ``common.pt``) would run ``touch``."""
    def make_cfg(d: Path) -> dict:
        import torch
        import torch.distributed.checkpoint as dcp

        step = d / "run" / "checkpoints" / "step-3"
        dcp.save({"w": torch.arange(256, dtype=torch.float32)}, checkpoint_id=str(step / "model"))
        (step / "COMPLETE").write_text("3\n")
        (step / "model" / what).write_bytes(_evil_pickle(d / "pwned", torch_name_first))
        return _base(d, trainer={"train_batch_size": 1}, actor={"mini_batch_size": 1})
    return make_cfg


def _crafted_conversion(d: Path) -> list[str]:
    from conversion.dist_ckpt import convert_hf_to_megatron
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    mg = convert_hf_to_megatron(tiny_checkpoint("tiny-qwen3"), d / "mg")
    (Path(mg) / ".metadata").write_bytes(_evil_pickle(d / "pwned", torch_name_first=True))
    return ["megatron-to-hf", "--megatron", str(mg), "--out", str(d / "hf-out")]


# Code from a checkpoint (issue 29, item 3): refused with the file named, and nothing ran.
CODE_CASES = [
    Case("train resuming a .metadata that runs code", train(_crafted_checkpoint(".metadata"), "--resume", "auto"),
         ("checkpoint {d}/run/checkpoints/step-3 is damaged", "step-3/model/.metadata: refusing to load posix.system")),
    Case("train resuming a .metadata naming torch first", train(_crafted_checkpoint(".metadata", True), "--resume",
                                                                 "auto"),
         ("step-3/model/.metadata: refusing to load torch.nn",)),
    Case("megatron-to-hf of a .metadata naming torch first", _crafted_conversion,
         ("{d}/mg/.metadata: refusing to load torch.nn", "not converted")),
]


@pytest.mark.parametrize("case", CODE_CASES, ids=[c.name for c in CODE_CASES])
def test_a_checkpoint_pickle_never_runs_code(case, tmp_path, capsys, monkeypatch):
    from conversion.__main__ import main as conversion_main

    monkeypatch.chdir(tmp_path)
    argv = case.make(tmp_path)
    capsys.readouterr()
    code = conversion_main(argv) if argv[0] == "megatron-to-hf" else cli.main(argv)
    err = capsys.readouterr().err
    assert not (tmp_path / "pwned").exists(), "the checkpoint's pickle ran code"
    assert code == 2, (code, err)
    for text in case.expect:
        assert text.replace("{d}", str(tmp_path)) in err, err
    assert "Traceback" not in err


def _converted(d: Path, nan_in: str | None = None) -> Path:
    """tiny-qwen3 as a Megatron checkpoint (``hf-to-megatron``), optionally with one NaN in HF tensor ``nan_in``."""
    import shutil

    from safetensors.torch import load_file, save_file

    from conversion.dist_ckpt import convert_hf_to_megatron
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    hf = Path(tiny_checkpoint("tiny-qwen3"))
    if nan_in is not None:
        shutil.copytree(hf, d / "hf-nan")
        hf = d / "hf-nan"
        for shard in hf.glob("*.safetensors"):
            tensors = load_file(shard)
            if nan_in in tensors:
                tensors[nan_in].view(-1)[7] = float("nan")
                save_file(tensors, shard, metadata={"format": "pt"})
    return convert_hf_to_megatron(hf, d / "mg")


def _corrupt_distcp(d: Path) -> list[str]:
    """4 KB of random bytes in the middle of the largest saved chunk (inside its tensor data)."""
    import random

    from megatron_arpo.ckpt_format.torch_dist import read_dcp_metadata

    mg = _converted(d)
    where = max(read_dcp_metadata(mg / ".metadata")[1].values(), key=lambda info: info.length)
    shard = mg / where.relative_path
    data = bytearray(shard.read_bytes())
    middle = where.offset + where.length // 2
    data[middle:middle + 4096] = random.Random(29).randbytes(4096)
    shard.write_bytes(bytes(data))
    return ["megatron-to-hf", "--megatron", str(mg), "--out", str(d / "hf-out")]


def _nonfinite(*extra: str) -> Callable[[Path], list[str]]:
    def make(d: Path) -> list[str]:
        mg = _converted(d, nan_in="model.layers.0.mlp.down_proj.weight")
        return ["megatron-to-hf", "--megatron", str(mg), "--out", str(d / "hf-out"), *extra]
    return make


# Integrity of megatron-to-hf (issue 29, item 7): a damaged shard or NaN weights are refused, named.
INTEGRITY_CASES = [
    Case("megatron-to-hf of a .distcp with 4 KB of random bytes", _corrupt_distcp,
         (".distcp: ", "fails its CRC-32 check", "the shard is corrupt, copy the checkpoint again")),
    Case("megatron-to-hf of a NaN weight", _nonfinite(),
         ("decoder.layers.mlp.linear_fc2.weight", "1 non-finite value(s) (NaN or Inf)", "--allow-nonfinite")),
]


@pytest.mark.parametrize("case", INTEGRITY_CASES, ids=[c.name for c in INTEGRITY_CASES])
def test_megatron_to_hf_refuses_damaged_weights(case, tmp_path, capsys):
    from conversion.__main__ import main as conversion_main

    argv = case.make(tmp_path)
    capsys.readouterr()
    code = conversion_main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    for text in case.expect:
        assert text.replace("{d}", str(tmp_path)) in err, err
    assert "Traceback" not in err and not (tmp_path / "hf-out").exists()


def test_allow_nonfinite_converts_the_nan_as_is(tmp_path):
    from safetensors.torch import load_file

    from conversion.__main__ import main as conversion_main

    assert conversion_main(_nonfinite("--allow-nonfinite")(tmp_path)) == 0
    weights = {k: v for shard in (tmp_path / "hf-out").glob("*.safetensors") for k, v in load_file(shard).items()}
    assert weights["model.layers.0.mlp.down_proj.weight"].isnan().sum() == 1


def _megatron_checkpoint(d: Path) -> Path:
    """A Megatron torch_dist checkpoint as Megatron lays it out (metadata.json, common.pt, DCP files),
    written without a process group."""
    import torch
    import torch.distributed.checkpoint as dcp

    out = d / "ckpt"
    dcp.save({"w": torch.arange(16, dtype=torch.float32)}, checkpoint_id=str(out))
    torch.save({"step": 3}, out / "common.pt")
    (out / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                   "common_backend": "torch", "common_backend_version": 1}))
    return out


def test_megatrons_own_loader_reads_checkpoint_pickles_only_through_the_allow_lists(tmp_path):
    """What the actor's resume calls (actor/checkpoint.py load_checkpoint): DCP's .metadata reader,
    Megatron's common.pt loader, DCP's byte items and our RNG file; each crafted file is refused, named."""
    import io

    import torch
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from megatron_arpo.actor import checkpoint_pickles

    checkpoint_pickles.install_restricted_unpickling()
    ckpt = _megatron_checkpoint(tmp_path)
    assert dist_checkpointing.load_tensors_metadata(str(ckpt))["w"].global_shape == (16,)  # a real one loads
    assert checkpoint_pickles.common_load_strategy().load_common(ckpt)["step"] == 3
    marker = tmp_path / "pwned"

    (ckpt / ".metadata").write_bytes(_evil_pickle(marker, torch_name_first=True))
    with pytest.raises(pickle_error(), match=rf"{ckpt}/\.metadata: refusing to load torch\.nn"):
        dist_checkpointing.load_tensors_metadata(str(ckpt))
    (ckpt / ".metadata").write_bytes(_evil_pickle(marker))
    with pytest.raises(pickle_error(), match=rf"{ckpt}/\.metadata: refusing to load posix\.system"):
        dist_checkpointing.load_tensors_metadata(str(ckpt))

    class Touch:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    torch.save({"step": Touch()}, ckpt / "common.pt")
    with pytest.raises(checkpoint_pickles.UnsafeCheckpointError, match=rf"{ckpt}/common\.pt: .*posix\.system"):
        checkpoint_pickles.common_load_strategy().load_common(ckpt)
    torch.save({"python": Touch()}, tmp_path / "rank_00000.pt")
    with pytest.raises(checkpoint_pickles.UnsafeCheckpointError, match="rank_00000.pt: .*posix.system"):
        checkpoint_pickles.load_rng_file(tmp_path / "rank_00000.pt")

    item = type("Item", (), {"dest_index": type("Index", (), {"fqn": "decoder._extra_state"})()})()
    payload = io.BytesIO()
    torch.save(Touch(), payload)
    with pytest.raises(checkpoint_pickles.UnsafeCheckpointError, match="decoder._extra_state"):
        DefaultLoadPlanner().load_bytes(item, io.BytesIO(payload.getvalue()))
    assert not marker.exists(), "a checkpoint pickle ran code"


def test_a_megatron_written_metadata_passes_the_allow_list(tmp_path):
    """Megatron's save planner leaves SavePlans (WriteItems, TensorWriteData, enums) in ``planner_data``."""
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
    from torch.distributed.checkpoint.planner import (BytesIOWriteData, SavePlan, TensorWriteData, WriteItem,
                                                      WriteItemType)

    from megatron_arpo.ckpt_format import dcp_pickles

    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([4]))
    items = [WriteItem(MetadataIndex("w", torch.Size([0])), WriteItemType.SHARD,
                       tensor_data=TensorWriteData(chunk, None, torch.Size([4]))),
             WriteItem(MetadataIndex("obj"), WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(nbytes=3))]
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata({}, planner_data=[SavePlan(items, {"w": ("w",)})])))
    with open(tmp_path / ".metadata", "rb") as fh:
        loaded = dcp_pickles.load_torch_metadata(fh)
    assert loaded.planner_data[0].items[1].type is WriteItemType.BYTE_IO


def test_the_resume_checks_every_record_crc(tmp_path):
    """DCP's chunk reader (what Megatron's loader calls on resume) refuses a flipped byte, naming the file."""
    import struct

    import torch
    import torch.distributed.checkpoint as dcp

    from megatron_arpo.ckpt_format.torch_dist import read_dcp_metadata
    from megatron_arpo.actor import checkpoint_pickles

    checkpoint_pickles.install_restricted_unpickling()
    ckpt = _megatron_checkpoint(tmp_path)
    loaded = {"w": torch.zeros(16)}
    dcp.load(loaded, checkpoint_id=str(ckpt))
    assert torch.equal(loaded["w"], torch.arange(16, dtype=torch.float32))
    where = read_dcp_metadata(ckpt / ".metadata")[1][("w", (0,))]
    shard = ckpt / where.relative_path
    data = bytearray(shard.read_bytes())
    data[where.offset + data[where.offset:].index(struct.pack("<4f", 4, 5, 6, 7))] ^= 0x40  # 4.0 -> 4.0000153
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"^{shard}: record at bytes .* fails its CRC-32 check.*resume from an earlier"):
        with checkpoint_pickles.refusals_named():
            dcp.load({"w": torch.zeros(16)}, checkpoint_id=str(ckpt))


class _HugeAnswer:
    """A retriever that answers 500 MB: with a Content-Length, or chunked without one (streamed until the
    client hangs up). Nothing is buffered here."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        import threading

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                chunked = self.path.endswith("/chunked")
                self.send_header(*(("Transfer-Encoding", "chunked") if chunked else ("Content-Length", str(500 << 20))))
                self.end_headers()
                block = b'{"result": [[' + b" " * ((1 << 20) - 14) + b"\n"
                try:
                    for _ in range(500):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(block), block) if chunked else block)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.mark.parametrize("path", ["/retrieve", "/retrieve/chunked"])
def test_a_500_mb_retriever_answer_is_a_tool_error(path):
    import asyncio

    from megatron_arpo.tools.registry import build_tools

    server = _HugeAnswer()
    try:
        executor = build_tools({"python": {"enabled": False}, "cache": None, "retries": 0,
                                "search": {"backend": "http", "url": server.url + path, "max_response_bytes": 1 << 20}})

        async def call():
            try:
                return await executor.execute("search", "q")
            finally:
                await executor.close()

        result = asyncio.run(call())
    finally:
        server.server.shutdown()
    assert result.error is not None and "Traceback" not in result.text
    assert "answered more than 1048576 bytes (tools.search.max_response_bytes)" in result.text, result.text


def pickle_error():
    import pickle

    return pickle.UnpicklingError


def _loop(d: Path) -> Path:
    """``d/a -> d/b -> d/a``: a symlink loop."""
    if not (d / "a").is_symlink():
        (d / "a").symlink_to(d / "b")
        (d / "b").symlink_to(d / "a")
    return d / "a"


DEEP_ROW = b'{"question": "q?", "answer": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"

# Symlink loops and deep JSON (issue 29, item 8): one clear line, exit 2.
CASES += [
    Case("config file is a symlink loop", lambda d: ["config", "validate", "--config", str(_loop(d))],
         ("{d}/a: a symlink loop (links that point back to each other)",)),
    Case("train file inside a symlink loop",
         validate(lambda d: _base(d, data={"train_files": [str(_loop(d) / "qa.jsonl")]}), "--paths", "train"),
         ("data.train_files[0]: file", "not found (a broken symlink or a symlink loop)")),
    Case("train with a run_dir that is a symlink loop",
         train(lambda d: _base(d, trainer={"run_dir": str(_loop(d)), "train_batch_size": 1},
                               actor={"mini_batch_size": 1})),
         ("{d}/a: a symlink loop", "give the real path")),
    Case("JSONL row nested 100k deep", data_file("qa.jsonl", [GOOD, DEEP_ROW]),
         ("qa.jsonl row 2: JSON nested too deeply", "flatten the row")),
    Case("SFT row nested 100k deep", sft_file("sft.jsonl", DEEP_ROW), ("sft.jsonl:1: JSON nested too deeply",)),
]


def test_an_eval_row_nested_100k_deep_is_a_dataset_error(tmp_path):
    from evaluation.datasets import DatasetError, load_dataset

    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_bytes(DEEP_ROW)
    with pytest.raises(DatasetError, match=r"test.jsonl line 1: JSON nested too deeply"):
        load_dataset("gsm8k", tmp_path)


@pytest.fixture(autouse=True)
def _console_handlers_stay_in_their_test():
    """`train` installs a console log handler bound to this test's captured stderr: remove it afterwards."""
    import logging

    yield
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_megatron_arpo", False)]:
        root.removeHandler(handler)


def test_the_table_is_big_enough():
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_exits_2_naming_it(case, tmp_path, capsys, monkeypatch):
    if case.root_only and os.geteuid() != 0:
        pytest.skip("the sandbox user is only used when the trainer runs as root")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MA_TEST_UNSET_KEY", raising=False)
    argv = case.make(tmp_path)
    capsys.readouterr()
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    for text in case.expect:
        assert text.replace("{d}", str(tmp_path)) in err, err
    assert "Traceback" not in err
    # One message (config errors may list several problems on it), not a log dump.
    assert len([line for line in err.splitlines() if "error" in line]) == 1, err


@pytest.mark.parametrize("name", ["config path is a directory", "non-UTF-8 YAML", "duplicate section",
                                  "answer list holds a mapping", "launch slurm with 0 nodes"])
def test_the_console_entry_point_behaves_the_same(name, tmp_path):
    case = next(c for c in CASES if c.name == name)
    argv = case.make(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "megatron_arpo", *argv], capture_output=True, text=True,
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert all(text.replace("{d}", str(tmp_path)) in proc.stderr for text in case.expect), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_a_bad_row_is_skipped_under_the_skip_policy(tmp_path, capsys):
    """The non-UTF-8 row that fails under `on_bad_row: error` is skipped (and named) under `skip`."""
    argv = data_file("qa.jsonl", [GOOD, b'{"question": "caf\xff?", "answer": "x"}\n'],
                     data={"on_bad_row": "skip"})(tmp_path)
    assert cli.main(argv) == 0
    assert "OK (paths and data checked for train)" in capsys.readouterr().out
    from megatron_arpo.data.datasets import load_prompts

    records, stats = load_prompts(tmp_path / "qa.jsonl", on_bad_row="skip")
    assert stats.skipped_bad == 1 and "qa.jsonl row 2: not UTF-8" in stats.errors[0] and len(records) == 1


# -- the python tool and its cache (issue 29): bounds, pathological code, unsafe cache paths
SANDBOX_CASES = [
    Case("max_capture_bytes above its range", validate(_python(max_capture_bytes=10**12)),
         ("tools.python.max_capture_bytes: 1000000000000 is out of range; allowed: >= 1 and <= 67108864",)),
    Case("tool cache under /proc", validate(lambda d: _base(d, tools={"search": {"enabled": False},
                                                                       "cache": {"path": "/proc/self/cache.sqlite"}})),
         ("tools.cache.path: '/proc/self/cache.sqlite' is under /proc, a kernel pseudo-filesystem",)),
]


@pytest.mark.parametrize("case", SANDBOX_CASES, ids=[c.name for c in SANDBOX_CASES])
def test_sandbox_bad_input_exits_2_naming_it(case, tmp_path, capsys, monkeypatch):
    test_bad_input_exits_2_naming_it(case, tmp_path, capsys, monkeypatch)


def test_validate_warns_for_an_unisolated_sandbox(tmp_path, capsys):
    argv = validate(_python(isolate_network=False, sandbox="best_effort"))(tmp_path)
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: tools.python.isolate_network: false shares the host's network" in err
    assert "warning: tools.python.sandbox: best_effort runs model-written code WITHOUT isolation" in err
    assert "Traceback" not in err
    (tmp_path / "plain").mkdir()
    assert cli.main(validate(_python())(tmp_path / "plain")) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("code, error", [
    ("print(1)\x00", "the code contains a NUL byte"),
    ("x = '\ud800'", "lone surrogate '\\ud800' at character 5"),
    ("1" * 200_000, "longer than 100000 bytes"),
])
def test_code_that_no_interpreter_takes_is_a_tool_error(code, error):
    from megatron_arpo.tools.python_sandbox import check_code

    result = check_code(code)
    assert result is not None and result.error and error in result.text


@pytest.mark.parametrize("code", ["(" * 5000 + ")" * 5000, "-" * 90_000 + "1", "a" + "[0]" * 30_000, "x = " + "not " * 20_000 + "1"])
def test_deeply_nested_code_leaves_auto_print_alone(code):
    """The trainer's parse for the notebook-style print must not raise: the sandboxed interpreter reports it."""
    from megatron_arpo.tools.python_sandbox import add_auto_print, check_code

    assert check_code(code) is None and add_auto_print(code) == code


def test_python_tool_refuses_an_unbounded_capture():
    from megatron_arpo.tools.python_sandbox import PythonSandboxTool

    with pytest.raises(ValueError, match="max_capture_bytes=1000000000000 is out of range"):
        PythonSandboxTool(max_capture_bytes=10**12)


def test_tool_cache_refuses_links_and_foreign_or_open_directories(tmp_path):
    from megatron_arpo.tools.cache import ToolCache

    elsewhere = tmp_path / "elsewhere.sqlite"
    elsewhere.write_bytes(b"")
    (tmp_path / "link").symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real").mkdir(mode=0o700)
    with pytest.raises(ValueError, match="the directory is a symbolic link"):
        ToolCache(tmp_path / "link" / "cache.sqlite")
    (tmp_path / "mine").mkdir(mode=0o700)
    (tmp_path / "mine" / "cache.sqlite").symlink_to(elsewhere)
    with pytest.raises(ValueError, match="the file is a symbolic link"):
        ToolCache(tmp_path / "mine" / "cache.sqlite")
    assert elsewhere.read_bytes() == b""  # SQLite never opened it
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(ValueError, match="writable by group or others"):
        ToolCache(tmp_path / "open" / "cache.sqlite")
    os.chmod(tmp_path / "open", 0o755)
    cache = ToolCache(tmp_path / "open" / "sub" / "cache.sqlite")  # made here: a private directory
    cache.close()
    assert oct(os.stat(tmp_path / "open" / "sub").st_mode & 0o777) == "0o700"


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user needs root")
def test_tool_cache_refuses_a_directory_another_user_made_first(tmp_path):
    """The attack on the old default: another user pre-creates the cache's directory and plants a file."""
    import pwd

    from megatron_arpo.tools.cache import ToolCache

    nobody = pwd.getpwnam("nobody")
    planted = tmp_path / "shared" / "megatron-arpo-0"
    planted.mkdir(parents=True, mode=0o700)
    os.chown(planted, nobody.pw_uid, nobody.pw_gid)
    with pytest.raises(ValueError, match=f"the directory belongs to uid {nobody.pw_uid}, not to this user"):
        ToolCache(planted / "tool_cache.sqlite")
    assert os.listdir(planted) == []
