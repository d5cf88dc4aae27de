"""``megatron-arpo eval`` / ``python -m evaluation``: evaluate an HF checkpoint on benchmark datasets.

    megatron-arpo eval --hf HF_DIR --datasets aime24,gsm8k,hotpotqa --data-dir DIR [--k 5]
                       [--config X.yaml [--set a.b=c ...]] [--out DIR] [--judge-url URL]

Settings come from, in increasing priority: the defaults of the config dataclasses, ``--config`` (its
``eval``, ``rollout``, ``tools``, ``data.system_prompt`` / ``chat_template`` / ``enable_thinking`` and
``model`` sections) with ``--set`` overrides, then the command-line flags. Without ``--config`` the search
tool is on only when ``--search-corpus`` (local BM25) or ``--search-url`` (HTTP retriever) is given; the
python sandbox is on unless ``--no-python``.

Exit codes: 0 done, 2 bad input (unknown dataset, missing file, model without tokenizer or chat template,
generation_config.json without the tokenizer's EOS, bad config).
A judge that is down is not an error: results.json says so and the headline falls back to rule metrics.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from evaluation.datasets import DATASETS, DatasetError, parse_dataset_names
from evaluation.report import format_markdown
from evaluation.runner import EngineSpec, EvalError, EvalSettings, LazyGenerator, open_rollout_generator, run_evaluation
from megatron_arpo.command_args import DeprecatedAlias
from megatron_arpo.config import ConfigError, ExperimentConfig, load_config
from megatron_arpo.data.chat import ChatFormatError, load_chat_format
from megatron_arpo.data.fields import FieldKeys
from megatron_arpo.data.system_prompts import resolve_system_prompt
from megatron_arpo.errors import as_symlink_loop
from megatron_arpo.redaction import install_log_redaction

logger = logging.getLogger(__name__)

PROG = "megatron-arpo eval"
EXIT_BAD_INPUT = 2


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog, description="Evaluate a checkpoint with the training tool loop: pass@1 mean±std, pass@k, "
                               "EM/F1/accuracy/math equivalence, optional LLM judge. Resumable.",
        epilog="known datasets: " + ", ".join(sorted(DATASETS)) + " (others: NAME:qa or NAME:math)")
    p.add_argument("--hf", dest="model", metavar="HF_DIR",
                   help="HF checkpoint directory (default: model.hf_checkpoint of --config)")
    p.add_argument("--model", dest="model", metavar="HF_DIR", action=DeprecatedAlias, new="--hf")
    p.add_argument("--tokenizer", help="tokenizer directory (default: model.tokenizer of --config, else --hf)")
    p.add_argument("--datasets", help="comma-separated dataset names or files (PATH[:qa|math]: parquet, JSONL, "
                                      "JSON; default: eval.datasets)")
    p.add_argument("--data-dir", help="directory holding <name>/test.jsonl (default: eval.data_dir)")
    p.add_argument("--k", type=int, help="samples per question (pass@k; default eval.k)")
    p.add_argument("--config", help="experiment YAML")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (needs --config), repeatable")
    p.add_argument("--out", help="output directory (default: eval.output_dir, else <run_dir>/eval, else "
                                 "eval_results/<model dir name>)")
    p.add_argument("--max-samples", type=int, help="cap per dataset (default: eval.max_samples, else 500)")
    p.add_argument("--temperature", type=float, help="sampling temperature, 0 = greedy (default eval.temperature)")
    p.add_argument("--greedy", action="store_true", help="temperature 0, k 1")
    p.add_argument("--top-p", type=float, help="default eval.top_p")
    p.add_argument("--response-length", type=int, help="tokens after the prompt (default rollout.response_length)")
    p.add_argument("--call-limit", type=int, help="tool calls per trajectory (default rollout.call_limit)")
    p.add_argument("--seed", type=int, help="sampling seed (default rollout.seed)")
    p.add_argument("--dtype", default="auto", help="vLLM dtype: auto, float32, bfloat16 (default: %(default)s)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="vLLM eager mode: no torch.compile at engine start (default rollout.enforce_eager)")
    p.add_argument("--search-corpus", help="enable search with local BM25 over this JSONL corpus")
    p.add_argument("--search-url", help="enable search through this FlashRAG-style retriever URL")
    p.add_argument("--no-python", action="store_true", help="disable the python tool")
    p.add_argument("--judge-url", help="OpenAI-compatible base URL of an LLM judge (enables the judge)")
    p.add_argument("--judge-model", help="judge model name (default eval.judge.model, else the server's first)")
    p.add_argument("--no-judge", action="store_true", help="disable the judge even if the config enables it")
    p.add_argument("--max-in-flight", type=int, default=32,
                   help="questions generated concurrently (default: %(default)s)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    return p


def _load_sections(args: argparse.Namespace) -> Any:
    """The experiment config: --config with --set, or the dataclass defaults."""
    if args.config:
        return load_config(args.config, args.overrides)
    if args.overrides:
        raise ConfigError([f"--set {args.overrides[0]}: needs --config; without a config use the eval flags "
                           "(--response-length, --call-limit, --search-corpus, ...)"])
    cfg = ExperimentConfig()
    # The default search backend is local BM25, which needs a corpus: without a config it is off unless
    # --search-corpus / --search-url turn it on.
    tools = dataclasses.replace(cfg.tools, search=dataclasses.replace(cfg.tools.search, enabled=False))
    return dataclasses.replace(cfg, tools=tools)


def _tools_config(args: argparse.Namespace, cfg: Any, out_dir: Path) -> dict[str, Any]:
    tools = dataclasses.asdict(cfg.tools)
    if args.search_corpus:
        tools["search"].update(enabled=True, backend="local", corpus=args.search_corpus)
    if args.search_url:
        tools["search"].update(enabled=True, backend="http", url=args.search_url)
    if args.no_python:
        tools["python"]["enabled"] = False
    if tools.get("cache") is not None and (not args.config or not tools["cache"].get("path")):
        tools["cache"]["path"] = str(out_dir / "tool_cache.sqlite")
    if tools["search"]["enabled"] and tools["search"]["backend"] == "local":
        corpus = tools["search"].get("corpus")
        if not corpus or not Path(corpus).exists():
            raise EvalError(f"search corpus {corpus!r} not found; pass --search-corpus PATH (a JSONL corpus) "
                            "or set tools.search.corpus")
    return tools


def load_chat(model_dir: str, tokenizer_dir: Optional[str] = None, chat_template_file: Optional[str] = None,
              enable_thinking: Optional[bool] = None) -> Any:
    """The checkpoint's `ChatFormat` (tokenizer, chat template, EOS ids, thinking prefix); EvalError otherwise."""
    tokenizer = load_tokenizer(model_dir, tokenizer_dir)
    try:
        return load_chat_format(tokenizer, model_dir, tokenizer_dir=tokenizer_dir or model_dir,
                                chat_template_file=chat_template_file, enable_thinking=enable_thinking)
    except ChatFormatError as exc:
        raise EvalError(str(exc)) from exc


def load_tokenizer(model_dir: str, tokenizer_dir: Optional[str] = None) -> Any:
    """The checkpoint's tokenizer; a clear EvalError when there is none."""
    model_path = Path(model_dir)
    if not model_path.is_dir():
        raise EvalError(f"--hf {model_dir!r} is not a directory; give an HF checkpoint directory "
                        "(config.json, weights, tokenizer files)")
    if not (model_path / "config.json").exists():
        raise EvalError(f"--hf {model_dir!r} has no config.json; it is not an HF checkpoint directory "
                        "(export one with `megatron-arpo convert megatron-to-hf`)")
    tok_path = Path(tokenizer_dir) if tokenizer_dir else model_path
    names = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any((tok_path / n).exists() for n in names):
        raise EvalError(f"{str(tok_path)!r} has no tokenizer (none of {', '.join(names)}); copy the tokenizer "
                        "files of the base model into the checkpoint directory, or pass --tokenizer DIR")
    # deferred: pulls in transformers (heavy; this module imports without it)
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tok_path))
    except Exception as exc:  # transformers raises many types for broken tokenizer files
        raise EvalError(f"cannot load the tokenizer in {str(tok_path)!r}: {exc}; pass --tokenizer DIR with "
                        "working tokenizer files") from exc
    return tokenizer


def _pick(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)


def prepare(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(EvalSettings, EngineSpec, judge kwargs or None) from the parsed arguments; raises on bad input."""
    cfg = _load_sections(args)
    ev = cfg.eval
    model = _pick(args.model, cfg.model.hf_checkpoint)
    if not model:
        raise EvalError("no model: pass --hf HF_DIR (or set model.hf_checkpoint in --config)")
    specs = parse_dataset_names(_pick(args.datasets, ev.datasets or None) or "")
    data_dir = _pick(args.data_dir, ev.data_dir)
    if not data_dir and any(spec.path is None for spec in specs):
        raise EvalError("no data directory: pass --data-dir DIR holding <name>/test.jsonl (or set eval.data_dir), "
                        "or give the datasets as file paths")
    if args.config:
        default_out = _pick(ev.output_dir, str(Path(cfg.trainer.run_dir or f"runs/{cfg.name}") / "eval"))
    else:
        default_out = str(Path("eval_results") / Path(model).resolve().name)
    out_dir = Path(_pick(args.out, default_out))
    temperature = 0.0 if args.greedy else _pick(args.temperature, ev.temperature)
    k = 1 if args.greedy else _pick(args.k, ev.k)
    rollout = dataclasses.replace(cfg.rollout, enforce_eager=True) if args.enforce_eager else cfg.rollout
    response_length = _pick(args.response_length, rollout.response_length)
    call_limit = _pick(args.call_limit, rollout.call_limit)
    seed = _pick(args.seed, rollout.seed)
    for name, value, low in (("--k", k, 1), ("--response-length", response_length, 1), ("--call-limit", call_limit, 0),
                             ("--max-in-flight", args.max_in_flight, 1)):
        if value < low:
            raise EvalError(f"{name} {value} must be >= {low}")
    if temperature < 0:
        raise EvalError(f"--temperature {temperature} must be >= 0 (0 = greedy)")
    tools_cfg = _tools_config(args, cfg, out_dir)
    chat = load_chat(model, _pick(args.tokenizer, cfg.model.tokenizer), cfg.data.chat_template, cfg.data.enable_thinking)
    try:
        system_prompt = resolve_system_prompt(cfg.data.system_prompt)  # a built-in name or the text
    except ValueError as exc:
        raise EvalError(str(exc)) from exc
    search = tools_cfg["search"]
    meta = {
        "response_length": response_length, "call_limit": call_limit, "seed": seed, "dtype": args.dtype,
        "enable_thinking": cfg.data.enable_thinking,
        "python_tool": bool(tools_cfg["python"]["enabled"]),
        "search_tool": (None if not search["enabled"] else
                        {"backend": search["backend"], "corpus": search.get("corpus"), "url": search.get("url"),
                         "topk": search["topk"]}),
    }
    settings = EvalSettings(model=str(Path(model).resolve()), datasets=specs,
                            data_dir=str(data_dir) if data_dir else None, out_dir=out_dir, k=k,
                            temperature=temperature, top_p=_pick(args.top_p, ev.top_p),
                            max_samples=_pick(args.max_samples, ev.max_samples), system_prompt=system_prompt,
                            max_in_flight=args.max_in_flight, generation_meta=meta,
                            field_keys=FieldKeys(cfg.data.prompt_key, cfg.data.answer_key))
    engine = EngineSpec(model_dir=str(model), chat=chat, rollout_section=rollout, tools_cfg=tools_cfg,
                        temperature=temperature, top_p=settings.top_p, response_length=response_length,
                        call_limit=call_limit, seed=seed, dtype=args.dtype)
    judge = None
    judge_url = _pick(args.judge_url, ev.judge.url if ev.judge.enabled else None)
    if judge_url and not args.no_judge:
        j = ev.judge
        judge = dict(url=judge_url, model=_pick(args.judge_model, j.model), api_key_env=j.api_key_env,
                     max_concurrency=j.max_concurrency, timeout_s=j.timeout_s, retries=j.retries,
                     cache_path=out_dir / "judge_cache.sqlite")
    return settings, engine, judge


async def _run(settings: Any, engine: Any, judge_kwargs: Optional[dict]) -> dict:
    # deferred: pulls in sqlite3, which this module's importers need not load
    from evaluation.judge import JudgeClient

    judge = JudgeClient(**judge_kwargs) if judge_kwargs else None
    # The engine starts only if something is left to generate (a finished run resumes without one).
    generator = LazyGenerator(lambda: open_rollout_generator(engine))
    try:
        return await run_evaluation(settings, generator, judge=judge)
    finally:
        await generator.close()
        if judge is not None:
            await judge.close()


def main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> int:
    args = build_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    try:
        settings, engine, judge = prepare(args)
        # Fail on a missing dataset file before the engine starts (load_dataset raises DatasetError).
        from evaluation.datasets import load_dataset

        for spec in settings.datasets:
            load_dataset(spec, settings.data_dir, settings.max_samples, settings.field_keys)
        results = asyncio.run(_run(settings, engine, judge))
    except (DatasetError, EvalError, ConfigError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (OSError, RuntimeError) as exc:  # a symlink loop in a path the user gave
        if as_symlink_loop(exc) is None:
            raise
        print(f"{prog}: error: {as_symlink_loop(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_markdown(results), end="")
    print(f"\nresults: {settings.out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
