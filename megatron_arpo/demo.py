"""``megatron-arpo demo --config configs/demo.yaml [--seed S] [--set a.b=c ...]``: the end-to-end CPU demo.

Stages, each run as its own subprocess (one heavy process at a time, each frees its memory, Ray and vLLM
included, before the next starts), each skipped when its output is already complete (a rerun resumes):

1. ``data``  — the synthetic task set (``megatron_arpo.data.demo_tasks.ensure_demo_tasks``) into
   ``<run_dir>/data`` and the random-init tiny checkpoint (``build_tiny_checkpoint``) into ``<run_dir>/init``,
   with the small local tokenizer, or with ``--tokenizer qwen3|qwq`` the real Qwen BPE;
2. ``sft``   — cold-start SFT (``megatron-arpo sft``) from ``init`` on the mixed tool/direct trajectories,
   HF export in ``<run_dir>/sft/hf``;
3. ``before`` — greedy evaluation of the SFT model on the validation prompts with the training tool loop
   (``megatron-arpo eval``), one dataset per data source, into ``<run_dir>/eval/before``;
4. ``train`` — ARPO (``megatron-arpo train``) from ``sft/hf`` with periodic validation, final policy in
   ``<run_dir>/hf``;
5. ``after`` — the same evaluation of ``<run_dir>/hf`` into ``<run_dir>/eval/after``;
6. the summary table (printed, and written to ``<run_dir>/summary.md`` and ``summary.json``).

The evaluation scores every response with the RL reward of the config (``data.reward``, deep_research:
-1 for a format error, else answer F1) and with exact-match accuracy, so "reward before/after" is the
quantity ARPO maximises. The training's own validation curve (``val/reward`` in ``metrics.jsonl``) is
shown next to it.

A run directory keeps one set of settings (``demo-settings.json``: the resolved config, seed and SFT tool
fraction); running it again with other settings is an error that asks for a fresh ``--run-dir``, since the
done-markers would otherwise skip stages whose outputs no longer match.

``--seed S`` changes the task set, the initial weights, the SFT/RL data order and the rollout sampling; the
run directory becomes ``<trainer.run_dir>-seed<S>`` unless ``--run-dir`` is given. ``--seeds 0,1,2`` runs the
demo once per seed (each in its ``-seed<S>`` directory, finished stages reused) and writes the table of the
validation reward before and after RL per seed, with the mean and the spread, to
``<trainer.run_dir>-seeds.md`` (and ``.json``): the figures the docs quote. Paths of the config
(data files, corpus, checkpoints) are replaced by the ones inside the run directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any, Iterable, Sequence

from megatron_arpo.data.system_prompts import DEFAULT_SYSTEM_PROMPT, resolve_system_prompt
from megatron_arpo.errors import InputError
from megatron_arpo.fsutil import atomic_write
from megatron_arpo.plot import OVERVIEW, plot_run
from megatron_arpo.progress import LOGGER_NAME as PROGRESS_LOGGER, strip_ansi
from megatron_arpo.redaction import install_log_redaction
from megatron_arpo.command_args import PROG, add_config_arguments

logger = logging.getLogger(__name__)

STAGES = ("data", "sft", "before", "train", "after")
DONE_SUFFIX = ".done.json"


def sft_system_prompt(value: str | None) -> str:
    """The system text of the demo's SFT rows: ``data.system_prompt`` resolved as the RL and evaluation prompts
    resolve it (a built-in name, the text, or null = ``default``); ``""`` (no system turn) for ``none``."""
    return resolve_system_prompt(value or DEFAULT_SYSTEM_PROMPT) or ""


def _seconds(t: float) -> str:
    return f"{t / 60:.1f} min" if t >= 60 else f"{t:.0f} s"


def relay_stage_output(lines: Iterable[str], log: IO[str], stage: str) -> None:
    """Copies a stage's output into its log file, without ANSI codes and with only the last state of a
    carriage-return-redrawn line; its progress lines (``megatron_arpo.progress``) also go to the console."""
    marker = f" {PROGRESS_LOGGER}: "
    for line in lines:
        text = strip_ansi(line.rstrip("\r\n")).rsplit("\r", 1)[-1]
        log.write(text + "\n")
        log.flush()
        if marker in text:
            logger.info("[%s] %s", stage, text.split(marker, 1)[1])


class Demo:
    """The stage runner; ``paths`` are all inside ``run_dir``."""

    def __init__(self, config: str, overrides: list[str], run_dir: Path, seed: int | None,
                 sft_tool_fraction: float, log_dir: Path | None = None, tokenizer: str = "local"):
        from megatron_arpo.config import load_config

        self.config = config
        self.user_overrides = list(overrides)
        self.cfg = load_config(config, overrides)
        self.run_dir = run_dir
        self.seed = seed
        self.sft_tool_fraction = sft_tool_fraction
        self.tokenizer = tokenizer
        self.logs = log_dir or run_dir / "logs"
        self.data_dir = run_dir / "data"
        self.init_dir = run_dir / "init"
        self.sft_dir = run_dir / "sft"
        self.eval_data = run_dir / "eval" / "data"
        self.final_hf = run_dir / "hf"
        self.times: dict[str, float] = {}

    # ---- plumbing ----------------------------------------------------------------------------------
    def _marker(self, stage: str) -> Path:
        return self.run_dir / f"stage-{stage}{DONE_SUFFIX}"

    def done(self, stage: str) -> bool:
        return self._marker(stage).is_file()

    def _mark(self, stage: str, seconds: float, **info: Any) -> None:
        self._marker(stage).write_text(json.dumps({"seconds": seconds, **info}, sort_keys=True) + "\n")

    def stage_seconds(self, stage: str) -> float | None:
        try:
            return float(json.loads(self._marker(stage).read_text())["seconds"])
        except (OSError, ValueError, KeyError):
            return None

    def path_overrides(self) -> list[str]:
        """--set items pointing every stage at the files of this run directory."""
        sets = [f"trainer.run_dir={self.run_dir}",
                f"model.hf_checkpoint={self.sft_dir / 'hf'}",
                f"data.train_files=[{self.data_dir / 'demo_train.jsonl'}]",
                f"data.val_files=[{self.data_dir / 'demo_val.jsonl'}]",
                f"tools.search.corpus={self.data_dir / 'demo_corpus.jsonl'}",
                f"tools.cache.path={self.run_dir / 'tool_cache.sqlite'}",
                f"sft.train_files=[{self.data_dir / 'demo_sft.jsonl'}]",
                f"sft.output_dir={self.sft_dir}"]
        if self.seed is not None:
            sets += [f"data.seed={self.seed}", f"actor.seed={1234 + self.seed}", f"rollout.seed={self.seed}"]
        # The user's --set wins, except trainer.run_dir: it chose this run directory (or its <dir>-seed<S>
        # base) already, and a stage pointed back at it would train every seed into one directory.
        user = [item for item in self.user_overrides if item.split("=", 1)[0].strip() != "trainer.run_dir"]
        return sets + user

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)  # the demo starts (and stops) its own local Ray
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{max(1, round(self.cfg.rollout.cpu_kv_cache_gib or 1))}")
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        env.setdefault("RAY_AUTH_MODE", "disabled")
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if not env.get("WANDB_API_KEY"):
            env.setdefault("WANDB_MODE", "offline")
        env.setdefault("WANDB_SILENT", "true")
        return env

    def _run(self, stage: str, args: list[str]) -> None:
        """``python -m megatron_arpo ARGS`` with the output in ``logs/<stage>.log``; raises on failure."""
        self.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.logs / f"{stage}.log"
        cmd = [sys.executable, "-m", "megatron_arpo", *args]
        logger.info("[%s] %s  (log: %s)", stage, " ".join(cmd[2:4]), log_path)
        with open(log_path, "a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n")
            log.flush()
            # Bytes, split at \n only: text mode would turn every \r of a redrawn bar into a line of its own.
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self._env()) as proc:
                try:
                    relay_stage_output((b.decode("utf-8", "replace") for b in proc.stdout), log, stage)
                    proc.wait()
                except BaseException:  # Ctrl-C: the stage does not outlive the demo
                    proc.kill()
                    raise
        if proc.returncode != 0:
            tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-25:])
            raise RuntimeError(f"demo stage {stage!r} failed with exit code {proc.returncode}; last lines of "
                               f"{log_path}:\n{tail}")

    def _config_args(self) -> list[str]:
        args = ["--config", self.config]
        for item in self.path_overrides():
            args += ["--set", item]
        return args

    # ---- stages -----------------------------------------------------------------------------------
    def stage_data(self) -> None:
        from megatron_arpo.data.demo_tasks import DEMO_SYSTEM_PROMPT, ensure_demo_tasks
        from megatron_arpo.tiny.checkpoint import build_tiny_checkpoint

        search = self.cfg.tools.search
        system_prompt = sft_system_prompt(self.cfg.data.system_prompt)
        if system_prompt != DEMO_SYSTEM_PROMPT:
            logger.warning("data.system_prompt is not DEMO_SYSTEM_PROMPT; the SFT rows use the config's prompt")
        ensure_demo_tasks(self.data_dir, self.seed or 0, sft_tool_fraction=self.sft_tool_fraction,
                          topk=search.topk, result_chars=search.result_chars, system_prompt=system_prompt)
        if not (self.init_dir / "config.json").is_file():
            build_tiny_checkpoint(self.cfg.model.config, self.init_dir, seed=self.seed or 0, overwrite=True,
                                  tokenizer=self.tokenizer)
        # The evaluation reads <dir>/<name>/test.jsonl: one dataset per data source of the val split.
        by_source: dict[str, list[str]] = {}
        for line in (self.data_dir / "demo_val.jsonl").read_text().splitlines():
            if line.strip():
                by_source.setdefault(json.loads(line)["data_source"], []).append(line)
        for source, lines in by_source.items():
            (self.eval_data / source).mkdir(parents=True, exist_ok=True)
            (self.eval_data / source / "test.jsonl").write_text("\n".join(lines) + "\n")

    def sources(self) -> list[str]:
        return sorted(p.name for p in self.eval_data.iterdir() if (p / "test.jsonl").is_file())

    def stage_sft(self) -> None:
        self._run("sft", ["sft", *self._config_args(), "--set", f"model.hf_checkpoint={self.init_dir}",
                          "--set", f"model.tokenizer={self.init_dir}", "--set", "sft.export_hf=true"])
        if not (self.sft_dir / "hf" / "config.json").is_file():
            raise RuntimeError(f"the sft stage finished without writing {self.sft_dir / 'hf'}")

    def _eval(self, stage: str, model: Path) -> None:
        out = self.run_dir / "eval" / stage
        self._run(stage, ["eval", *self._config_args(), "--hf", str(model), "--tokenizer", str(model),
                          "--datasets", ",".join(f"{s}:qa" for s in self.sources()),
                          "--data-dir", str(self.eval_data), "--out", str(out), "--greedy",
                          "--max-samples", str(self.cfg.eval.max_samples or 100000), "--dtype", self.eval_dtype()])

    def eval_dtype(self) -> str:
        """The rollout engines' dtype (the actor's): vLLM's "auto" is bfloat16 on CPU, and the SFT model's
        greedy tool-or-answer choice is a near tie that bfloat16 rounding flips (seen: 26% vs 7% tool calls)."""
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(str(self.cfg.actor.params_dtype),
                                                                             "auto")

    def stage_before(self) -> None:
        self._eval("before", self.sft_dir / "hf")

    def stage_train(self) -> None:
        self._run("train", ["train", *self._config_args(), "--set", "trainer.export_hf_at_end=true",
                            "--resume", "auto"])
        if not (self.final_hf / "config.json").is_file():
            raise RuntimeError(f"the train stage finished without writing the final policy {self.final_hf}")

    def stage_after(self) -> None:
        self._eval("after", self.final_hf)

    def check_settings(self) -> None:
        """Stages are skipped by their done-markers, so one run directory must keep one set of settings."""
        from megatron_arpo.config import load_config

        resolved = load_config(self.config, self.path_overrides()).to_dict()
        settings = {"config": resolved, "seed": self.seed, "sft_tool_fraction": self.sft_tool_fraction}
        if self.tokenizer != "local":  # absent for the default, so earlier run directories stay valid
            settings["tokenizer"] = self.tokenizer
        settings = json.loads(json.dumps(settings, sort_keys=True, default=str))
        path = self.run_dir / "demo-settings.json"
        if path.is_file():
            old = json.loads(path.read_text())
            if old != settings:
                changed = sorted(k for k in _flatten(settings) if _flatten(settings).get(k) != _flatten(old).get(k))
                raise RuntimeError(f"{self.run_dir} holds a demo run with other settings (changed: "
                                   f"{', '.join(changed[:8])}); delete that directory, or pass --run-dir DIR")
        else:
            path.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n")

    def run(self, stages: Sequence[str]) -> dict:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.check_settings()
        for stage in stages:
            if self.done(stage):
                logger.info("[%s] done already (%s); skipping", stage, self._marker(stage).name)
                continue
            start = time.perf_counter()
            logger.info("[%s] starting", stage)
            getattr(self, f"stage_{stage}")()
            seconds = time.perf_counter() - start
            self._mark(stage, seconds)
            logger.info("[%s] finished in %s", stage, _seconds(seconds))
        return write_summary(self)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


# ---- the summary ----------------------------------------------------------------------------------
def eval_stats(out_dir: Path, reward_name: str) -> dict[str, dict[str, float]]:
    """Per data source (and "all"): RL reward, exact-match accuracy, F1, tool calls per trajectory."""
    from megatron_arpo.rewards import get_reward_fn

    reward_fn = get_reward_fn(reward_name)
    per: dict[str, list[dict]] = {}
    for path in sorted(out_dir.glob("*/samples.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                per.setdefault(rec["dataset"], []).append(rec)
    stats = {}
    every: list[dict] = []
    for name, recs in sorted(per.items()):
        rows = [{"reward": float(reward_fn(r["response_text"], r["gold"], data_source=name)),
                 "accuracy": float(r["metrics"].get("em", 0.0)), "f1": float(r["metrics"].get("f1", 0.0)),
                 "tool_calls": float(r["num_tool_calls"]), "uses_tool": float(r["num_tool_calls"] > 0)}
                for r in recs]
        every += rows
        stats[name] = _means(rows)
    if every:
        stats["all"] = _means(every)
    return stats


def _means(rows: list[dict]) -> dict[str, float]:
    out = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
    out["n"] = len(rows)
    return out


def train_stats(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "metrics.jsonl"
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    steps = [r for r in rows if "reward/mean" in r]
    val = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]

    def mean(key: str, part: list[dict]) -> float | None:
        vals = [r[key] for r in part if key in r]
        return sum(vals) / len(vals) if vals else None

    first, last = steps[:3], steps[-3:]
    return {
        "steps": len(steps),
        "val_curve": val,
        "train_reward_first3": mean("reward/mean", first), "train_reward_last3": mean("reward/mean", last),
        "calls_per_traj_first3": mean("tools/calls_per_traj", first),
        "calls_per_traj_last3": mean("tools/calls_per_traj", last),
        "branches_per_prompt": mean("rollout/branches_per_prompt", steps),
        "step_seconds": mean("time/step_s", steps),
    }


def curve_lines(run_dir: Path) -> list[str]:
    """The markdown embedding the training curves (``megatron-arpo plot``: ``plots/curves.png``), if any."""
    if not (run_dir / "metrics.jsonl").is_file():
        return []
    try:
        written = plot_run(run_dir)
    except InputError as exc:  # no step logged yet
        logger.warning("no learning curves: %s", exc)
        return []
    curve = run_dir / "plots" / f"{OVERVIEW}.png"
    if curve not in written:
        return []
    return [f"![learning curves: reward, accuracy, tool calls, entropy, KL, step time]"
            f"({curve.relative_to(run_dir).as_posix()})", ""]


def _f(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def write_summary(demo: Demo) -> dict:
    reward = demo.cfg.data.reward
    before = eval_stats(demo.run_dir / "eval" / "before", reward)
    after = eval_stats(demo.run_dir / "eval" / "after", reward)
    train = train_stats(demo.run_dir)
    lines = [f"# megatron-arpo demo: {demo.run_dir}", "",
             f"config `{demo.config}`, seed {demo.seed or 0}, reward `{reward}` (greedy, validation prompts)", "",
             "| data source | n | reward before | reward after | accuracy before | accuracy after "
             "| tool calls/traj before | tool calls/traj after |",
             "|---|---|---|---|---|---|---|---|"]
    for name in sorted(set(before) | set(after), key=lambda s: (s == "all", s)):
        b, a = before.get(name, {}), after.get(name, {})
        lines.append(f"| {name} | {int(b.get('n') or a.get('n') or 0)} | {_f(b.get('reward'))} | {_f(a.get('reward'))} "
                     f"| {_f(b.get('accuracy'))} | {_f(a.get('accuracy'))} | {_f(b.get('tool_calls'), 2)} "
                     f"| {_f(a.get('tool_calls'), 2)} |")
    lines += ["", "ARPO training:", "",
              f"- steps: {train['steps']}; training reward (mean of the first / last 3 steps): "
              f"{_f(train['train_reward_first3'])} -> {_f(train['train_reward_last3'])}",
              f"- tool calls per trajectory (first / last 3 steps): {_f(train['calls_per_traj_first3'], 2)} -> "
              f"{_f(train['calls_per_traj_last3'], 2)}",
              f"- branches per prompt (mean over steps): {_f(train['branches_per_prompt'], 2)}",
              "- validation reward during training (step: val/reward): "
              + (", ".join(f"{s}: {v:.3f}" for s, v in train["val_curve"]) or "-"), "",
              *curve_lines(demo.run_dir), "Wall time per stage:", ""]
    total = 0.0
    for stage in STAGES:
        sec = demo.stage_seconds(stage)
        total += sec or 0.0
        lines.append(f"- {stage}: {'-' if sec is None else _seconds(sec)}")
    lines.append(f"- total: {_seconds(total)}")
    text = "\n".join(lines) + "\n"
    (demo.run_dir / "summary.md").write_text(text)
    summary = {"before": before, "after": after, "train": train,
               "stage_seconds": {s: demo.stage_seconds(s) for s in STAGES}, "seed": demo.seed or 0}
    (demo.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    summary["markdown"] = text
    return summary


def _mean_spread(values: Sequence[float]) -> tuple[float, float, float, float]:
    """Mean, population standard deviation, min and max."""
    mean = sum(values) / len(values)
    return mean, (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5, min(values), max(values)


def seeds_table(summaries: Sequence[dict], config: str) -> tuple[str, dict]:
    """The per-seed table of validation reward and accuracy (all sources) before and after RL, with spread."""
    rows, cols = [], {"reward before": [], "reward after": [], "gain": [], "accuracy before": [], "accuracy after": []}
    for s in summaries:
        b, a = s["before"].get("all", {}), s["after"].get("all", {})
        vals = [b.get("reward"), a.get("reward"), None, b.get("accuracy"), a.get("accuracy")]
        if vals[0] is not None and vals[1] is not None:
            vals[2] = vals[1] - vals[0]
        for key, value in zip(cols, vals):
            if value is not None:
                cols[key].append(value)
        rows.append(f"| {s['seed']} | " + " | ".join(_f(v) for v in vals) + " |")
    stats = {key: dict(zip(("mean", "std", "min", "max"), _mean_spread(v))) for key, v in cols.items() if v}
    header = "| seed | " + " | ".join(cols) + " |"
    lines = [f"# megatron-arpo demo over seeds {', '.join(str(s['seed']) for s in summaries)}", "",
             f"config `{config}`; greedy validation, all data sources; "
             f"`{PROG} demo --config {config} --seeds {','.join(str(s['seed']) for s in summaries)}`", "",
             header, "|" + "---|" * (len(cols) + 1), *rows]
    for stat in ("mean", "std", "min", "max"):
        lines.append(f"| {stat} | " + " | ".join(_f(stats[k][stat]) if k in stats else "-" for k in cols) + " |")
    return "\n".join(lines) + "\n", {"seeds": [s["seed"] for s in summaries], "columns": cols, "stats": stats}


def run_seeds(args: argparse.Namespace, cfg: Any, stages: list[str], seeds: list[int]) -> int:
    summaries = []
    for seed in seeds:
        demo = Demo(args.config, args.overrides, Path(f"{cfg.run_dir}-seed{seed}"), seed, args.sft_tool_fraction,
                    tokenizer=args.tokenizer)
        logger.info("demo seed %d of %s: %s", seed, seeds, demo.run_dir)
        try:
            summaries.append(demo.run(stages))
        except RuntimeError as exc:
            print(f"{PROG} demo: error (seed {seed}): {exc}", file=sys.stderr)
            return 1
    text, data = seeds_table(summaries, args.config)
    base = Path(f"{cfg.run_dir}-seeds")
    with atomic_write(base.with_suffix(".md")) as fh:
        fh.write(text)
    with atomic_write(base.with_suffix(".json")) as fh:
        fh.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(text, end="")
    print(f"\nseed table: {base.with_suffix('.md')}")
    return 0


def demo_main(argv: Sequence[str]) -> int:
    from megatron_arpo.data.demo_tasks import DEFAULT_SFT_TOOL_FRACTION
    from megatron_arpo.tiny.checkpoint import TOKENIZER_KINDS

    parser = argparse.ArgumentParser(prog=f"{PROG} demo", description=__doc__.split("\n\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--seed", type=int, default=None,
                        help="task set / init / data order / sampling seed (default: the config's seeds, data 0)")
    parser.add_argument("--seeds", default=None, metavar="S,S,...",
                        help="run the demo once per seed and write the table with mean and spread "
                             "(<trainer.run_dir>-seeds.md); each seed's run directory is <trainer.run_dir>-seed<S>")
    parser.add_argument("--run-dir", default=None, help="default: trainer.run_dir, with -seed<S> for --seed S")
    parser.add_argument("--sft-tool-fraction", type=float, default=DEFAULT_SFT_TOOL_FRACTION,
                        help="share of the SFT trajectories that call the tool (default: %(default)s)")
    parser.add_argument("--tokenizer", default="local", choices=TOKENIZER_KINDS,
                        help="tokenizer of the initial checkpoint: the small local one (default), or the real Qwen "
                             "BPE of qwen3 / qwq, which needs a model.config at its vocabulary size "
                             "(e.g. tiny-qwen3-qwen-vocab / tiny-qwq-qwen-vocab)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated subset of {','.join(STAGES)} (default: all; the summary is always written)")
    args = parser.parse_args(list(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    install_log_redaction()
    from megatron_arpo.config import load_config

    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir) if args.run_dir else (
        cfg.run_dir if args.seed is None else Path(f"{cfg.run_dir}-seed{args.seed}"))
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        parser.error(f"--stages: unknown {bad}; choose from {','.join(STAGES)}")
    if args.seeds is not None:
        try:
            seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        except ValueError:
            parser.error(f"--seeds: give comma-separated integers, e.g. 0,1,2 (got {args.seeds!r})")
        if not seeds or len(set(seeds)) != len(seeds) or args.seed is not None or args.run_dir:
            parser.error("--seeds: give distinct seeds, without --seed or --run-dir")
        return run_seeds(args, cfg, stages, seeds)
    demo = Demo(args.config, args.overrides, run_dir, args.seed, args.sft_tool_fraction, tokenizer=args.tokenizer)
    start = time.perf_counter()
    try:
        summary = demo.run(stages)
    except RuntimeError as exc:
        print(f"{PROG} demo: error: {exc}", file=sys.stderr)
        return 1
    print(summary["markdown"], end="")
    print(f"\nsummary: {run_dir / 'summary.md'}  (this invocation: {_seconds(time.perf_counter() - start)})")
    return 0
