"""``scripts/_venv.sh`` on a machine that already has its torch (a GPU image, often offline):
``VEOMNI_TORCH=system`` makes a venv that uses that torch and installs nothing from the network
when everything is there; a Python without a supported torch is refused before anything is
made; ``scripts/_deps.py`` says which dependencies are missing and which of them every run needs.
The auto choice takes the system torch only for a CUDA build, so a CPU machine keeps the pin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from veomni.data.builders import load_script

pytestmark = pytest.mark.full  # whole runs / multi-rank trainers: the full tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
DEPS = REPO / "scripts" / "_deps.py"


def _source_venv(tmp_path: Path, python: str, *command: str, **env: str) -> subprocess.CompletedProcess:
    script = f'source "{REPO}/scripts/_venv.sh" && {" ".join(command)}'
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHON": python, "VEOMNI_VENV": str(tmp_path / "venv"), **env})


def test_system_torch_is_used_and_nothing_comes_from_the_network(tmp_path):
    wheels = tmp_path / "wheels"  # empty: were pip asked for anything, --no-index would make it fail
    wheels.mkdir()
    done = _source_venv(tmp_path, sys.executable, "python -c 'import torch, veomni; print(torch.__file__)'",
                        VEOMNI_TORCH="system", VEOMNI_WHEELS=str(wheels))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == torch.__file__, "the venv must use the torch that is already there"
    assert (tmp_path / "venv" / ".veomni-torch").read_text().strip() == "system"
    assert "every run needs" not in done.stderr and "[venv] installing" not in done.stderr, done.stderr
    # a second launch reuses the venv without asking pip again
    again = _source_venv(tmp_path, sys.executable, "true")
    assert again.returncode == 0 and "installing" not in again.stderr, again.stderr


def test_a_python_without_a_supported_torch_is_refused_before_a_venv_is_made(tmp_path):
    no_site = tmp_path / "python-without-packages"
    no_site.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -I "$@"\n')
    no_site.chmod(0o755)
    done = _source_venv(tmp_path, str(no_site), "true", VEOMNI_TORCH="system")
    assert done.returncode == 2
    assert "no torch installed" in done.stderr and "VEOMNI_TORCH=system" in done.stderr
    assert not (tmp_path / "venv").exists()


def test_auto_takes_only_a_cuda_build():
    deps = load_script(DEPS)
    assert deps.torch_fits(need_cuda=False) is None, "this torch is in the supported range"
    assert (deps.torch_fits(need_cuda=True) is None) == bool(torch.version.cuda)
    if not torch.version.cuda:
        assert "not a CUDA build" in deps.torch_fits(need_cuda=True)


def test_missing_dependencies_are_named_and_sorted_by_need(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["torch>=2.11", "pyyaml>=6", "webdataset-absent>=1",\n'
                         '"tokenizers>=0.21", "wandb-absent>=0.19"]\n')
    listed = subprocess.run([sys.executable, str(DEPS), "--requirements", str(pyproject)],
                            capture_output=True, text=True, check=True).stdout.split()
    assert listed == ["pyyaml>=6", "webdataset-absent>=1", "tokenizers>=0.21", "wandb-absent>=0.19"]
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["torch>=2.11", "pyyaml>=6", "tokenizers>=99",\n'
                         '"webdataset-absent>=1", "wandb-absent>=0.19"]\n')
    to_install = subprocess.run([sys.executable, str(DEPS), "--unmet", str(pyproject)],
                                capture_output=True, text=True, check=True).stdout.split()
    assert to_install == ["tokenizers>=99", "webdataset-absent>=1", "wandb-absent>=0.19"], "absent or too old"
    done = subprocess.run([sys.executable, str(DEPS), "--check-imports", str(pyproject)],
                          capture_output=True, text=True)
    assert done.returncode == 0, "only features need the absent ones"
    assert "needed only by the features that use them: webdataset-absent, wandb-absent" in done.stderr
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["torch>=2.11", "pyyaml>=6", "tokenizers>=0.21"]\n')
    needed = subprocess.run([sys.executable, "-S", str(DEPS), "--check-imports", str(pyproject)],
                            capture_output=True, text=True)
    assert needed.returncode == 1 and "every run needs them: pyyaml, tokenizers" in needed.stderr
    assert "VEOMNI_WHEELS" in needed.stderr
