"""``megatron-arpo convert`` (also ``python -m conversion``): hf-to-megatron, megatron-to-hf, verify, shapes.

``shapes`` (formerly ``plan``, still accepted with a warning) lists every rank's parameter shapes; the memory
plan is ``megatron-arpo plan``. Errors a user can fix (bad paths, configs, checkpoints) print one
``megatron-arpo convert: error:`` line and exit 2; a failed verify or shapes check exits 1; SIGTERM or Ctrl-C removes the unfinished output (exit 143 / 130).
``megatron-to-hf`` never imports megatron-core, nor torch unless a tensor must go through memory (see
:mod:`conversion.megatron_to_hf`); it prints the conversion report (``conversion.json``), every
``config.json`` field it changed included.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from megatron_arpo.command_args import PROG as MAIN_PROG
from megatron_arpo.errors import as_symlink_loop
from megatron_arpo.hf.config_json import FieldChange
from megatron_arpo.hf.checkpoint_io import parse_size
from megatron_arpo.device.quiet import quiet_cpu_warnings
from megatron_arpo.hf.outdir import MARKER
from megatron_arpo.model_config import load_model_config
from megatron_arpo.progress import LOGGER_NAME as PROGRESS_LOGGER


def _model_cfg(path):
    if path is None:
        return None

    return load_model_config(path)


def cmd_hf_to_megatron(args) -> int:
    # deferred: pulls in numpy (heavy; this module imports without it)
    from conversion.dist_ckpt import convert_hf_to_megatron

    out = convert_hf_to_megatron(args.hf, args.out, tp=args.tp, pp=args.pp, model_cfg=_model_cfg(args.model_config),
                                 overwrite=args.overwrite, dtype=args.dtype)  # a name: torch only if it casts
    print(f"wrote Megatron distributed checkpoint {out} (vocab padded for tp={args.tp}; loads at any TP/PP)")
    return 0


def cmd_megatron_to_hf(args) -> int:
    # deferred: pulls in numpy (heavy; this module imports without it)
    from conversion.megatron_to_hf import convert_megatron_to_hf

    out = convert_megatron_to_hf(args.megatron, args.out, tokenizer=args.tokenizer,
                                 max_shard_size=parse_size(args.max_shard_size),
                                 model_cfg=_model_cfg(args.model_config), overwrite=args.overwrite,
                                 allow_nonfinite=args.allow_nonfinite)
    report = json.loads((out / MARKER).read_text())
    print(f"wrote HF checkpoint {out} ({report['num_tensors']} tensors, {report['dtype']}; report: {out / MARKER})")
    config = report["config_json"]
    changed = [FieldChange.from_dict(c) for c in config["changed"]]
    origin = config["origin"]
    if not origin.startswith("generated"):
        origin = f"carried over from {origin}"
    print(f"config.json: {origin}; " + (f"{len(changed)} field(s) changed:" if changed else "no field changed"))
    for change in changed:
        print(f"  {change.describe()}")
    return 0


def cmd_verify(args) -> int:
    # deferred: pulls in torch (heavy; this module imports without it)
    from conversion.verify import run_verify

    layouts = [(args.tp, args.pp)] if args.tp or args.pp else None
    return 0 if run_verify(args.hf, print, model_config=args.model_config, layouts=layouts,
                           timeout=args.timeout) else 1


def cmd_shapes(args) -> int:
    # deferred: pulls in torch (heavy; this module imports without it)
    from conversion.plan import run_plan

    if args.command == "plan":
        print(f"{PROG} plan: warning: renamed; use `{PROG} shapes` (the memory plan is `{MAIN_PROG} plan`)",
              file=sys.stderr)
    return 0 if run_plan(_model_cfg(args.model_config), args.tp, args.pp, print) else 1


PROG = f"{MAIN_PROG} convert"
MODEL_CONFIG_HELP = "model config: a model_configs/ name or a YAML path"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="HF <-> Megatron checkpoint conversion and checks.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress at INFO level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{hf-to-megatron,megatron-to-hf,verify,shapes}")

    p = sub.add_parser("hf-to-megatron", help="HF safetensors -> Megatron distributed checkpoint")
    p.add_argument("--hf", required=True, help="HF checkpoint directory")
    p.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size the vocab padding is made for (default: 1)")
    p.add_argument("--pp", type=int, default=1,
                   help="pipeline-parallel size (validated; layout is resharding; default: 1)")
    p.add_argument("--model-config", help=f"{MODEL_CONFIG_HELP} (default: derived from config.json)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's dtype")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out written by this command")
    p.set_defaults(fn=cmd_hf_to_megatron)

    p = sub.add_parser("megatron-to-hf", help="Megatron distributed checkpoint -> HF safetensors")
    p.add_argument("--megatron", required=True, help="converted or training checkpoint directory")
    p.add_argument("--out", required=True, help="output HF directory (must not exist unless --overwrite)")
    p.add_argument("--tokenizer", help="directory with tokenizer files (default: those recorded at conversion)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default: %(default)s)")
    p.add_argument("--model-config", help=f"{MODEL_CONFIG_HELP} (default: model_config.yaml beside the checkpoint)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out written by this command")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="convert weights holding NaN or Inf (refused by default: a damaged or diverged checkpoint)")
    p.set_defaults(fn=cmd_megatron_to_hf)

    p = sub.add_parser("verify", help="round trip bit-exactness and HF vs Megatron logits parity")
    p.add_argument("--hf", required=True, help="HF checkpoint directory")
    p.add_argument("--tp", type=int, default=0, help="check only this layout (default: TP=1, TP=2, PP=2)")
    p.add_argument("--pp", type=int, default=0, help="with --tp: the layout's pipeline size (default: 1)")
    p.add_argument("--model-config", help=f"{MODEL_CONFIG_HELP} (default: derived from config.json)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per layout (default: %(default)s)")
    p.set_defaults(fn=cmd_verify)

    for name, shown in (("shapes", "dry run: every rank's parameter shapes on the meta device"),
                        ("plan", f"deprecated name of `shapes` (the memory plan is `{MAIN_PROG} plan`)")):
        p = sub.add_parser(name, help=shown)
        p.add_argument("--model-config", required=True, help=MODEL_CONFIG_HELP)
        p.add_argument("--tp", type=int, required=True, help="tensor-parallel size")
        p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
        p.set_defaults(fn=cmd_shapes)
    return parser


def main(argv=None) -> int:
    quiet_cpu_warnings()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger(PROGRESS_LOGGER).setLevel(logging.INFO)  # minutes at 32B: progress lines even without -v
    if args.command == "verify":
        args.tp = args.tp or (1 if args.pp else 0)
        args.pp = args.pp or (1 if args.tp else 0)
    # SIGTERM and Ctrl-C unwind the stack, so the temporary output directory is removed on the way out.
    # The signal is also recorded: raised inside a torch C++ callback (torch.load reading a stream) the
    # KeyboardInterrupt comes back as some other error, which must not be reported as a corrupt input.
    _received.clear()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
        signal.signal(signal.SIGINT, _on_signal)
    try:
        return args.fn(args)
    except BaseException as exc:
        if _received or isinstance(exc, KeyboardInterrupt):
            signum = _received[0] if _received else signal.SIGINT
            print(f"interrupted by {signal.Signals(signum).name}; the unfinished output was removed", file=sys.stderr)
            return 128 + signum
        if isinstance(exc, USER_ERRORS) or as_symlink_loop(exc) is not None:
            print(f"{PROG} {args.command}: error: {as_symlink_loop(exc) or exc}", file=sys.stderr)
            return 2
        raise


USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, KeyError, NotImplementedError, PermissionError,
               IsADirectoryError, NotADirectoryError)
_received: list[int] = []


def _on_signal(signum, frame):
    _received.append(signum)
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
