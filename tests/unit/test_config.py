"""The experiment config: loading, --set coercion, validation messages, redaction and `config show`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_arpo import cli
from megatron_arpo.config import (
    REDACTED,
    ConfigError,
    ExperimentConfig,
    build_config,
    describe_fields,
    load_config,
    redact,
    resolved_model,
    validate_paths,
)

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"


def write_yaml(tmp_path: Path, data: dict, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def minimal(**sections) -> dict:
    """A valid small config (tiny model, python tool only) with sections merged over it."""
    raw = {"model": {"config": "tiny-qwen3"}, "rollout": {"response_length": 512},
           "data": {"max_prompt_tokens": 256}, "tools": {"search": {"enabled": False}}, "launcher": {"gpus_per_node": 0}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def errors_of(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        build_config(raw)
    return str(info.value)


# ------------------------------------------------------------------------------------------ demo
def test_demo_loads_and_validates():
    cfg = load_config(DEMO)
    assert cfg.name == "demo"
    assert cfg.model.config == "tiny-qwen3"
    assert 1 <= cfg.rollout.initial_rollouts < cfg.rollout.n and cfg.rollout.beam_size == 2  # ARPO, not GRPO
    assert cfg.rollout.num_engines == 1
    assert cfg.actor.tensor_parallel == 1 and cfg.actor.params_dtype == "fp32" and cfg.actor.use_te == "false"
    assert cfg.trainer.placement == "colocated"
    assert cfg.rollout.max_model_len == cfg.data.max_prompt_tokens + cfg.rollout.response_length
    model = resolved_model(cfg)
    assert model.name == "tiny-qwen3" and model.head_dim == 64 and model.tie_word_embeddings


def test_reference_defaults():
    r, alg = ExperimentConfig().rollout, ExperimentConfig().algorithm
    assert (r.branch_threshold, r.entropy_weight, r.entropy_window, r.logprobs_topk, r.call_limit) == (0.5, 0.2, 20, 10, 3)
    assert (r.entropy_estimator, r.branch_timing, r.variant, r.scheduler) == ("reference", "after_result", "arpo", "async")
    assert (alg.clip_low, alg.clip_high, alg.dual_clip, alg.aggregation) == (0.2, 0.2, 3.0, "token-mean")
    assert alg.kl.kind == "low_var_kl" and alg.kl.coef == 0.0


def test_dump_yaml_round_trips(tmp_path):
    cfg = load_config(DEMO, ["launcher.time=04:00:00", "launcher.env.OMP_NUM_THREADS=1", "tools.cache=null"])
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.dump_yaml())
    assert load_config(path) == cfg


def test_verify_sync_first_is_the_default_and_checks_the_first_sync_of_each_process():
    """A wrong transport stops the job at its first sync (step 1, or the first after a resume)."""
    from megatron_arpo.actor.group import verifies_sync

    assert build_config(minimal()).rollout.verify_sync == "first"
    assert [verifies_sync("first", done) for done in range(3)] == [True, False, False]
    assert [verifies_sync("true", done) for done in range(3)] == [True, True, True]
    assert [verifies_sync("false", done) for done in range(3)] == [False, False, False]
    with pytest.raises(ValueError, match=r"rollout.verify_sync='always'; allowed: first, true, false"):
        verifies_sync("always", 0)


def test_null_parallelism_resolves_from_model_defaults():
    raw = minimal(model={"config": "qwen3-32b"}, launcher={"nodes": 4, "gpus_per_node": 8})
    cfg = build_config(raw)
    assert (cfg.actor.tensor_parallel, cfg.actor.pipeline_parallel, cfg.rollout.tensor_parallel) == (8, 4, 4)
    assert cfg.trainer.run_dir == "runs/default"


# ------------------------------------------------------------------------------------ coercion
@pytest.mark.parametrize(
    ("override", "getter", "expected"),
    [
        ("rollout.n=8", lambda c: c.rollout.n, 8),
        ("actor.optimizer.lr=1e-6", lambda c: c.actor.optimizer.lr, 1e-6),
        ("actor.optimizer.lr=3", lambda c: c.actor.optimizer.lr, 3.0),
        ("rollout.temperature=0.7", lambda c: c.rollout.temperature, 0.7),
        ("rollout.verify_sync=true", lambda c: c.rollout.verify_sync, "true"),
        ("rollout.verify_sync=yes", lambda c: c.rollout.verify_sync, "true"),
        ("rollout.verify_sync=1", lambda c: c.rollout.verify_sync, "true"),
        ("rollout.verify_sync=no", lambda c: c.rollout.verify_sync, "false"),
        ("rollout.verify_sync=first", lambda c: c.rollout.verify_sync, "first"),
        ("data.shuffle=no", lambda c: c.data.shuffle, False),
        ("data.shuffle=False", lambda c: c.data.shuffle, False),
        ("data.shuffle=0", lambda c: c.data.shuffle, False),
        ("name=exp-1", lambda c: c.name, "exp-1"),
        ("data.prompt_key=123", lambda c: c.data.prompt_key, "123"),  # str stays str
        ("data.system_prompt=a=b", lambda c: c.data.system_prompt, "a=b"),  # split on the first '='
        ("model.tokenizer=null", lambda c: c.model.tokenizer, None),
        ("rollout.max_num_seqs=64", lambda c: c.rollout.max_num_seqs, 64),
        ("rollout.max_num_seqs=none", lambda c: c.rollout.max_num_seqs, None),
        ("data.train_files=[a.jsonl, b.parquet]", lambda c: c.data.train_files, ["a.jsonl", "b.parquet"]),
        ("data.train_files=a.jsonl,b.parquet", lambda c: c.data.train_files, ["a.jsonl", "b.parquet"]),
        ("data.train_files=[]", lambda c: c.data.train_files, []),
        ("rollout.variant=aepo", lambda c: c.rollout.variant, "aepo"),
        ("actor.use_te=true", lambda c: c.actor.use_te, "true"),
        ("algorithm.kl.kind=k2", lambda c: c.algorithm.kl.kind, "k2"),
        ("algorithm.dual_clip=null", lambda c: c.algorithm.dual_clip, None),
        ("launcher.env.NCCL_DEBUG=INFO", lambda c: c.launcher.env, {"NCCL_DEBUG": "INFO"}),
    ],
)
def test_set_coercion(override, getter, expected):
    value = getter(load_config(DEMO, [override]))
    assert value == expected and type(value) is type(expected)


def test_yaml_values_are_coerced_too(tmp_path):
    # PyYAML reads `1e-6` (no dot) as a string; `use_te: true` as a bool; env values as ints.
    path = tmp_path / "exp.yaml"
    path.write_text("model: {config: tiny-qwen3}\nrollout: {response_length: 512}\ndata: {max_prompt_tokens: 256}\n"
                    "tools: {search: {enabled: false}}\nactor: {optimizer: {lr: 1e-6}, use_te: true}\n"
                    "launcher: {gpus_per_node: 0, env: {OMP_NUM_THREADS: 1}}\n")
    cfg = load_config(path)
    assert cfg.actor.optimizer.lr == 1e-6 and isinstance(cfg.actor.optimizer.lr, float)
    assert cfg.actor.use_te == "true"
    assert cfg.launcher.env == {"OMP_NUM_THREADS": "1"}


def test_with_overrides_returns_a_new_validated_config():
    cfg = load_config(DEMO)
    n = cfg.rollout.n
    new = cfg.with_overrides([f"rollout.n={2 * n}", f"rollout.initial_rollouts={2 * n}"])
    assert (new.rollout.n, new.rollout.initial_rollouts, cfg.rollout.n) == (2 * n, 2 * n, n)
    with pytest.raises(ConfigError, match="rollout.initial_rollouts"):
        cfg.with_overrides([f"rollout.initial_rollouts={n + 1}"])
    # Derived values follow the override (max_model_len was null in demo.yaml).
    longer = cfg.with_overrides(["rollout.response_length=1024", "name=other", "trainer.run_dir=null"])
    assert longer.rollout.max_model_len == cfg.data.max_prompt_tokens + 1024
    assert longer.trainer.run_dir == "runs/other" and longer.tools.cache.path is None  # node-local, at run time
    assert longer.with_overrides([]) == longer


# -------------------------------------------------------------------------------------- errors
def test_unknown_keys_suggest(tmp_path):
    msg = errors_of(minimal(rolout={"n": 4}))
    assert "rolout: unknown key (did you mean 'rollout'?)" in msg
    msg = errors_of(minimal(rollout={"beam_sise": 2}))
    assert "rollout.beam_sise: unknown key (did you mean 'rollout.beam_size'?)" in msg
    msg = errors_of(minimal(tools={"python": {"timeout": 3}}))
    assert "tools.python.timeout: unknown key (did you mean 'tools.python.timeout_s'?)" in msg
    with pytest.raises(ConfigError, match=r"tools\.cache\.paht: unknown key \(did you mean 'tools\.cache\.path'\?\)"):
        load_config(DEMO, ["tools.cache.paht=x"])
    msg = errors_of(minimal(actor={"zzz": 1}))
    assert "actor.zzz: unknown key; allowed keys under actor: tensor_parallel" in msg
    with pytest.raises(ConfigError, match=r"rollout\.beem_size: unknown key \(did you mean 'rollout\.beam_size'\?\)"):
        load_config(DEMO, ["rollout.beem_size=3"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(DEMO, ["rollout.n"])
    with pytest.raises(ConfigError, match="actor.optimizer: is a section"):
        load_config(DEMO, ["actor.optimizer=adam"])
    with pytest.raises(ConfigError, match="rollout.n is a value, not a section"):
        load_config(DEMO, ["rollout.n.x=1"])


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"rollout": {"n": "four"}}, "rollout.n: expected an integer, got 'four' (str)"),
        ({"rollout": {"n": 2.5}}, "rollout.n: expected an integer, got 2.5 (float)"),
        ({"rollout": {"n": True}}, "rollout.n: expected an integer, got True (bool)"),
        ({"rollout": {"temperature": "hot"}}, "rollout.temperature: expected a number, got 'hot'"),
        ({"actor": {"use_distributed_optimizer": "maybe"}}, "actor.use_distributed_optimizer: expected a boolean"),
        ({"data": {"train_files": 3}}, "data.train_files: expected a list, got 3 (int)"),
        ({"data": {"train_files": ["a.jsonl", 7]}}, "data.train_files[1]: expected a string, got 7 (int)"),
        ({"launcher": {"time": 14400}}, "launcher.time: expected a string, got 14400 (int); quote"),
        ({"actor": 3}, "actor: expected a mapping of ActorSection keys, got 3 (int)"),
        ({"rollout": {"n": None}}, "rollout.n: must not be null"),
    ],
)
def test_wrong_types(sections, expected):
    assert expected in errors_of(minimal(**sections))


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"rollout": {"n": 0}}, "rollout.n: 0 is out of range; allowed: >= 1"),
        ({"algorithm": {"clip_low": -1}}, "algorithm.clip_low: -1.0 is out of range; allowed: > 0 and < 1"),
        ({"rollout": {"entropy_estimator": "foo"}}, "rollout.entropy_estimator: 'foo' is not allowed; allowed: ['reference', 'mean']"),
        ({"rollout": {"entropy_estimator": "men"}}, "(did you mean 'mean'?)"),
        ({"rollout": {"top_p": 1.5}}, "rollout.top_p: 1.5 is out of range; allowed: > 0 and <= 1"),
        ({"rollout": {"beam_size": 0}}, "rollout.beam_size: 0 is out of range; allowed: >= 1"),
        ({"rollout": {"branch_threshold": 1.2}}, "rollout.branch_threshold: 1.2 is out of range"),
        ({"algorithm": {"dual_clip": 1.0}}, "algorithm.dual_clip: 1.0 is out of range; allowed: > 1"),
        ({"algorithm": {"kl": {"kind": "k4"}}}, "algorithm.kl.kind: 'k4' is not allowed"),
        ({"launcher": {"ray_gcs_port": 70000}}, "launcher.ray_gcs_port: 70000 is out of range; allowed: >= 1024 and <= 65535"),
        ({"launcher": {"ray_ports_per_node": 10}}, "launcher.ray_ports_per_node: 10 is out of range; allowed: >= 20"),
        ({"launcher": {"preempt_exit_code": 130}}, "launcher.preempt_exit_code: 130 is out of range; allowed: >= 1 and <= 125"),
    ],
)
def test_out_of_range(sections, expected):
    assert expected in errors_of(minimal(**sections))


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"rollout": {"n": 4, "initial_rollouts": 5}}, "rollout.initial_rollouts: 5 exceeds rollout.n 4; allowed: 1..4"),
        ({"rollout": {"n": 4, "initial_rollouts": 2, "beam_size": 5}}, "rollout.beam_size: 5 exceeds rollout.n 4"),
        ({"algorithm": {"kl": {"coef": 0.01}}}, "algorithm.kl.coef: 0.01 needs reference log-probs; set algorithm.use_reference: true"),
        ({"actor": {"tensor_parallel": 3}}, "actor.tensor_parallel: 3 does not divide tiny-qwen3 num_attention_heads 4; valid values: [1, 2]"),
        ({"rollout": {"tensor_parallel": 4}}, "rollout.tensor_parallel: 4 does not divide tiny-qwen3 num_key_value_heads 2; valid values: [1, 2]"),
        ({"actor": {"pipeline_parallel": 3}}, "actor.pipeline_parallel: 3 does not divide tiny-qwen3 num_hidden_layers 2; valid values: [1, 2]"),
        ({"actor": {"micro_batch_tokens": 100}}, "actor.micro_batch_tokens: 100 cannot hold one full sequence of 768"),
        ({"rollout": {"max_model_len": 700}}, "rollout.max_model_len: 700 is below"),
        ({"rollout": {"response_length": 5000}}, "exceeds tiny-qwen3 max_position_embeddings 4096"),
        ({"actor": {"mini_batch_size": 3}}, "actor.mini_batch_size: 3 does not divide trainer.train_batch_size 128"),
        ({"trainer": {"placement": "separate"}}, "trainer.actor_devices: required when trainer.placement is 'separate'"),
        ({"launcher": {"nodes": 1, "gpus_per_node": 6}, "actor": {"tensor_parallel": 4}},
         "actor.tensor_parallel x actor.pipeline_parallel = 4 does not divide the 6 actor devices"),
        ({"launcher": {"nodes": 1, "gpus_per_node": 8}, "actor": {"data_parallel": 2}},
         "actor.data_parallel: 2 gives a world of 2 but there are 8 actor devices; set it to 8 or null"),
        ({"launcher": {"gpus_per_node": 8}, "trainer": {"placement": "separate", "actor_devices": 6, "rollout_devices": 4}},
         "exceeds the 8 devices"),
        ({"trainer": {"placement": "separate", "actor_devices": 1, "rollout_devices": 1}, "rollout": {"enable_sleep_mode": True}},
         "rollout.enable_sleep_mode: true frees GPU memory for the other side of a colocated GPU, but trainer.placement "
         "is 'separate' (actor and engines own their GPUs); set rollout.enable_sleep_mode: false, or trainer.placement: "
         "colocated"),
        ({"trainer": {"placement": "separate", "actor_devices": 1, "rollout_devices": 1}, "actor": {"offload": True}},
         "actor.offload: true frees GPU memory for the other side of a colocated GPU, but trainer.placement is 'separate'"),
        ({"actor": {"sequence_parallel": True}}, "actor.sequence_parallel: true needs actor.tensor_parallel > 1 (it splits the sequence over the TP "
         "ranks); set actor.sequence_parallel: false, or actor.tensor_parallel to one of [2]"),
        ({"tools": {"search": {"enabled": True}}}, "tools.search.corpus: required when tools.search.backend is 'local'"),
        ({"tools": {"search": {"enabled": True, "backend": "http"}}}, "tools.search.url: required"),
        ({"tools": {"search": {"tag": "python"}}}, "tools.search.tag: 'python' is also tools.python.tag"),
        ({"tools": {"python": {"tag": "Py thon"}}}, "tools.python.tag: 'Py thon' is not a valid tag name"),
        ({"tools": {"python": {"timeout_s": 60}}}, "tools.python.timeout_s: 60.0 exceeds tools.timeout_s 30.0"),
        ({"tools": {"search": {"api_key_env": "sk-live-0123456789abcdef"}}}, "is not an environment variable NAME"),
        ({"launcher": {"env": {"WANDB_API_KEY": "abc"}}}, "launcher.env.WANDB_API_KEY: secrets must not be written"),
        ({"data": {"reward": "no such reward"}}, "data.reward: 'no such reward' is neither a built-in reward"),
        ({"launcher": {"ray_gcs_port": 20100, "ray_node_port_base": 20000}},
         "launcher.ray_gcs_port: 20100 falls inside the per-node port blocks 20000-20199"),
        ({"launcher": {"nodes": 300, "ray_node_port_base": 20000}},
         "launcher.ray_node_port_base: 300 nodes x 200 ports from 20000 end at 79999 > 65535"),
        ({"launcher": {"nodes": 300}}, "launcher.ray_port_range: 20000-32000 holds 60 blocks of 200 ports but 300 nodes"),
        ({"launcher": {"ray_port_range": "32000-20000"}}, "launcher.ray_port_range: '32000-20000' must satisfy"),
        ({"launcher": {"exclusive": False}}, "launcher.cpus_per_task: null means every CPU of the node, which needs "
                                             "launcher.exclusive: true"),
        ({"launcher": {"exclusive": False, "cpus_per_task": 8}}, "launcher.memory_per_node: 'all' (--mem=0)"),
        ({"launcher": {"memory_per_node": "lots"}}, "launcher.memory_per_node: got 'lots'; allowed: all, a Slurm size"),
        ({"launcher": {"time": "4 hours"}}, "launcher.time: '4 hours' is not a Slurm time"),
        ({"launcher": {"job_name": "my job"}}, "launcher.job_name: 'my job'; allowed: a non-empty name without spaces"),
    ],
)
def test_cross_section_checks(sections, expected):
    assert expected in errors_of(minimal(**sections))


def test_the_api_key_itself_never_appears_in_the_error():
    msg = errors_of(minimal(tools={"search": {"api_key_env": "sk-live-0123456789abcdef"}}))
    assert "0123456789abcdef" not in msg


def test_all_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        build_config(minimal(rollout={"n": 2, "initial_rollouts": 3, "beam_size": 4}, algorithm={"kl": {"coef": 0.1}}))
    keys = [e.split(":")[0] for e in info.value.errors]
    assert keys == ["rollout.initial_rollouts", "rollout.beam_size", "algorithm.kl.coef"]


def test_model_config_is_required_and_checked():
    assert "model.config: required" in errors_of({"tools": {"search": {"enabled": False}}})
    msg = errors_of(minimal(model={"config": "qwen9-1b"}))
    assert "model.config:" in msg and "qwen9-1b" in msg and "tiny-qwen3" in msg


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="YAML syntax error"):
        load_config(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(bad)


# ------------------------------------------------------------------------------------ base: file
def test_base_inheritance_and_cycles(tmp_path):
    write_yaml(tmp_path, minimal(rollout={"n": 8, "initial_rollouts": 4}, name="parent"), "parent.yaml")
    (tmp_path / "sub").mkdir()
    child = write_yaml(tmp_path / "sub", {"base": "../parent.yaml", "name": "child", "rollout": {"n": 6}})
    cfg = load_config(child, ["rollout.beam_size=3"])
    assert cfg.name == "child"
    assert (cfg.rollout.n, cfg.rollout.initial_rollouts, cfg.rollout.beam_size) == (6, 4, 3)
    assert cfg.rollout.response_length == 512  # inherited, nested merge
    write_yaml(tmp_path, {"base": "b.yaml"}, "a.yaml")
    write_yaml(tmp_path, {"base": "a.yaml"}, "b.yaml")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config(tmp_path / "a.yaml")


# --------------------------------------------------------------------------------- validate_paths
def test_validate_paths(tmp_path, monkeypatch):
    cfg = load_config(DEMO)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        validate_paths(cfg)
    text = str(info.value)
    for key in ("model.hf_checkpoint", "data.train_files[0]", "data.val_files[0]", "tools.search.corpus"):
        assert key in text
    for rel in ("runs/demo/sft/hf",):
        (tmp_path / rel).mkdir(parents=True)
    for rel in (*cfg.data.train_files, *cfg.data.val_files, cfg.tools.search.corpus, *cfg.sft.train_files):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}\n")
    validate_paths(cfg)
    validate_paths(cfg, for_command="sft")
    with pytest.raises(ConfigError, match="data.train_files: empty"):
        validate_paths(cfg.with_overrides(["data.train_files=[]"]))


# -------------------------------------------------------------------------------------- redaction
def test_redact_masks_secret_strings_only():
    data = {"api_key": "sk-1", "nested": {"HF_TOKEN": "hf_x", "db_password": "pw", "client_secret": "s"},
            "api_key_env": "BRIGHT_DATA_API_KEY", "max_prompt_tokens": 512, "prompt_key": "question",
            "tokenizer": "/ckpt/tok", "items": [{"token": "t"}], "num_token_budget": 7}
    out = redact(data)
    assert out["api_key"] == REDACTED and out["items"][0]["token"] == REDACTED
    assert out["nested"] == {"HF_TOKEN": REDACTED, "db_password": REDACTED, "client_secret": REDACTED}
    assert out["api_key_env"] == "BRIGHT_DATA_API_KEY"
    assert out["max_prompt_tokens"] == 512 and out["num_token_budget"] == 7
    assert out["prompt_key"] == "question" and out["tokenizer"] == "/ckpt/tok"
    assert data["api_key"] == "sk-1"  # the input is not modified


def test_config_redacted_keeps_env_var_names():
    cfg = load_config(DEMO, ["data.prompt_key=question", "model.tokenizer=runs/tok"])
    red = cfg.redacted()
    assert red["tools"]["search"]["api_key_env"] == "BRIGHT_DATA_API_KEY"
    assert red["eval"]["judge"]["api_key_env"] == "OPENAI_API_KEY"
    assert red["data"]["prompt_key"] == "question" and red["model"]["tokenizer"] == "runs/tok"
    assert REDACTED not in yaml.safe_dump(red)


def test_describe_fields_lists_every_leaf_once():
    rows = describe_fields()
    paths = [r[0] for r in rows]
    assert len(paths) == len(set(paths))
    assert "rollout.beam_size" in paths and "launcher.max_requeues" in paths and "tools.python.cpu_s" in paths

    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and k != "env":
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    assert paths == list(leaves(ExperimentConfig().to_dict()))


# ------------------------------------------------------------------------------------------- CLI
def test_cli_config_show_prints_resolved_yaml(capsys):
    assert cli.main(["config", "show", "--config", str(DEMO), "--set", "rollout.n=8"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown == load_config(DEMO, ["rollout.n=8"]).redacted()
    assert shown["rollout"]["n"] == 8


def test_cli_config_show_json_and_validate(capsys):
    assert cli.main(["config", "show", "--config", str(DEMO), "--format", "json"]) == 0
    assert '"beam_size": 2' in capsys.readouterr().out
    assert cli.main(["config", "validate", "--config", str(DEMO)]) == 0
    assert "OK" in capsys.readouterr().out


def test_cli_config_errors_exit_2_with_one_line(capsys):
    assert cli.main(["config", "show", "--config", str(DEMO), "--set", "rollout.beem_size=3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "did you mean 'rollout.beam_size'?" in lines[0]
    assert cli.main(["config", "show", "--config", str(DEMO), "--set", "rollout.n=0"]) == 2
    assert "rollout.n: 0 is out of range" in capsys.readouterr().err


def test_cli_usage_errors(capsys):
    assert cli.main([]) == 2
    assert cli.main(["confg"]) == 2
    assert "did you mean 'config'?" in capsys.readouterr().err
    assert cli.main(["config", "show"]) == 2  # --config missing: argparse usage error
    assert cli.main(["--version"]) == 0


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "megatron_arpo", "config", "show", "--config", str(DEMO),
                           "--set", "rollout.n=0"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "rollout.n: 0 is out of range" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "megatron_arpo", "config", "show", "--config", str(DEMO)],
                          capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["model"]["config"] == "tiny-qwen3"


def test_actor_world_size_and_devices():
    cpu = load_config(DEMO)
    assert cpu.layout.total_devices is None and cpu.layout.world_size == 1
    gpu = build_config(minimal(model={"config": "qwen3-32b"}, launcher={"nodes": 4, "gpus_per_node": 8}))
    assert gpu.layout.total_devices == 32 and gpu.layout.world_size == 32
    split = gpu.with_overrides(["trainer.placement=separate", "trainer.actor_devices=16", "trainer.rollout_devices=16",
                                "actor.pipeline_parallel=2"])
    assert split.layout.world_size == 16


def test_tools_section_feeds_build_tools(tmp_path):
    """The resolved tools section is exactly what megatron_arpo.tools.registry.build_tools accepts."""
    from megatron_arpo.tools.registry import build_tools

    cfg = load_config(DEMO, [f"trainer.run_dir={tmp_path / 'run'}", "tools.search.enabled=false"])
    assert cfg.tools.cache.path is None  # the trainer puts it on node-local disk (checkpointing.tool_cache_path)
    assert cfg.tools.enabled_tags == ["python"]
    tools = cfg.to_dict()["tools"]
    tools["cache"]["path"] = str(tmp_path / "cache.sqlite")
    executor = build_tools(tools)
    assert executor is not None
    assert load_config(DEMO, ["tools.cache=null"]).tools.cache is None


def test_use_te_flag():
    assert [load_config(DEMO, [f"actor.use_te={v}"]).actor.use_te_flag for v in ("auto", "true", "false")] == [
        None, True, False]


def test_launcher_section_feeds_launcher_options():
    """The launcher section is exactly what launchers.options.launcher_options accepts."""
    from launchers.options import launcher_options

    cfg = load_config(DEMO, ["launcher.nodes=2", "launcher.time=1-00:00:00", "launcher.env.NCCL_DEBUG=WARN"])
    opts = launcher_options(cfg.launcher, {"run_dir": cfg.trainer.run_dir})
    assert (opts.nodes, opts.gpus_per_node, opts.time, opts.run_dir) == (2, 0, "1-00:00:00", "runs/demo")
    assert opts.env == {"NCCL_DEBUG": "WARN"}


def test_builtin_reward_names_match_the_reward_registry():
    from megatron_arpo import rewards
    from megatron_arpo.config_schema import BUILTIN_REWARDS

    assert set(BUILTIN_REWARDS) == set(rewards.BUILTIN_REWARDS)
