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
    (d / "hf").mkdir(exist_ok=True)  # `config validate --paths` checks the directory exists; `train` cases use a real one
    cfg = {"name": "bad", "model": {"config": "tiny-qwen3", "hf_checkpoint": str(d / "hf")}, "rollout": {"response_length": 256},
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
    Case("answer is a number", data_file("qa.jsonl", [GOOD, GOOD, {"question": "q?", "answer": 42}]),
         ("qa.jsonl row 3: 'answer' is 42 (int)", 'write a number as a string, e.g. "42"')),
    Case("answer list holds a number", data_file("qa.jsonl", [{"question": "q?", "answer": ["a", 7]}]),
         ("qa.jsonl row 1: 'answer' is [\"a\", 7] (list)",)),
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
    Case("SFT file of the wrong kind", sft_file("sft.txt", b"hello"), ("sft.txt: SFT files must end in .json",)),
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
                                  "answer is a number", "launch slurm with 0 nodes"])
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
