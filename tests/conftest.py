"""Shared test setup: offline, small-footprint defaults for every tier.

Environment variables are set before any test module imports vllm/transformers/wandb, so engines never
claim most of the RAM for KV cache (vLLM's CPU default) and nothing tries to reach a hub.
"""

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# tests/support (the scripted engine, the local Slurm cluster) imports as ``support`` here and in children.
_TESTS = str(Path(__file__).resolve().parent)
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, os.environ.get("PYTHONPATH")) if p)


# The real-vocabulary tiny checkpoints (the Qwen BPE tokenizer, megatron_arpo/tiny/qwen_tokenizer.py):
# built once per machine (cached under .cache/tiny), shared by every tier.
import pytest  # noqa: E402

from support.root_logging import restore_root_handlers  # noqa: E402,F401  (autouse: every test)
from support.xdist_groups import ModuleGroupScheduling  # noqa: E402

# The Ray cluster fixtures (tests/integration/ray_cluster.py), defined once for every tier. A session fixture
# imported into several test modules is a separate fixture per module (pytest keeps one definition per
# importing module): each module started, and kept until the session ended, a 2-raylet cluster of its own.
sys.path.insert(0, str(Path(__file__).resolve().parent / "integration"))
from ray_cluster import _ray_two_node_cluster, ray_single_node, ray_two_nodes  # noqa: E402,F401  (fixtures)


@pytest.fixture(scope="session")
def qwen3_checkpoint():
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    return tiny_checkpoint("tiny-qwen3-qwen-vocab", tokenizer="qwen3")


@pytest.fixture(scope="session")
def qwq_checkpoint():
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    return tiny_checkpoint("tiny-qwq-qwen-vocab", tokenizer="qwq")


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_checkpoint))


# The heavy tiers run on two pytest-xdist workers with ``--dist loadgroup`` (Makefile, target ``test``): whole
# modules, or the groups of modules in tests/support/xdist_groups.py, each on one worker.
@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") == "loadgroup":
        return ModuleGroupScheduling(config, log)
    return None
