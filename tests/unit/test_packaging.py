"""The installed package stands alone: a non-editable install resolves model configs by name."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_non_editable_install_resolves_model_configs_by_name(tmp_path):
    # Built from a copy of the sources: setuptools writes build/ and *.egg-info next to what it builds.
    source, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".venv*", ".git", ".cache", "build", "*.egg-info",
                                                                  "runs", "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, cwd=tmp_path, capture_output=True)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from megatron_arpo.model_config import MODEL_CONFIG_DIR, load_model_config; "
            "cfg = load_model_config('qwq-32b'); "
            "print(MODEL_CONFIG_DIR); print(cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size)")
    # -I: no user site, no PYTHONPATH, no current directory; only the installed copy (and site-packages).
    out = subprocess.run([sys.executable, "-I", "-c", code, str(target)], check=True, cwd=tmp_path,
                         capture_output=True, text=True).stdout.split("\n")
    assert Path(out[0]) == target / "megatron_arpo" / "model_configs"
    assert out[1] == "qwen2 64 5120"
    assert sorted(p.name for p in (target / "megatron_arpo" / "model_configs").glob("*.yaml")) == \
        sorted(p.name for p in (REPO / "model_configs").glob("*.yaml"))
