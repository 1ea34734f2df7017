"""deploy/mlx_backend.sh (which MLX backend `make venv` installs) run for real, with a fake nvidia-smi on PATH.

PATH holds only the tools the script and make use (linked into a temp dir), so a real nvidia-smi on the machine
running the tests cannot change the answers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "mlx_backend.sh"

SMI_LIST = "GPU 0: NVIDIA H200 (UUID: GPU-2f1c9b2e-0000-0000-0000-000000000000)"
SMI_HEADER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 580.65.06              Driver Version: 580.65.06      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
"""


def _tools(tmp_path: Path, names: tuple[str, ...]) -> Path:
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for name in names:
        found = shutil.which(name)
        if found is None:
            pytest.skip(f"{name} is not installed")
        link = tools / name
        if not link.exists():
            link.symlink_to(found)
    return tools


def _fake_smi(tmp_path: Path, cuda: str | None = "13.0", fails: bool = False) -> Path:
    """A directory holding an nvidia-smi that answers like a driver supporting `cuda` (or fails like no driver)."""
    gpu = tmp_path / "gpu"
    gpu.mkdir(exist_ok=True)
    smi = gpu / "nvidia-smi"
    if fails:
        body = 'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver." ; exit 9\n'
    else:
        header = SMI_HEADER.format(cuda=cuda) if cuda else "| NVIDIA-SMI 999.0 |\n"
        body = f'if [ "${{1:-}}" = -L ]; then echo "{SMI_LIST}"; exit 0; fi\ncat <<"EOF"\n{header}EOF\n'
    smi.write_text("#!/bin/sh\n" + body)
    smi.chmod(0o755)
    return gpu


def _run(tmp_path: Path, *args: str, gpu: Path | None = None, backend: str | None = None,
         cmd: list[str] | None = None, extra_tools: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    tools = _tools(tmp_path, ("sh", "sed", "grep", "head", "uname", "cat", *extra_tools))
    env = {"PATH": os.pathsep.join(str(p) for p in (gpu, tools) if p), "HOME": str(tmp_path)}
    if backend is not None:
        env["MLX_BACKEND"] = backend
    return subprocess.run(cmd or ["sh", str(SCRIPT), *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def _choice(tmp_path: Path, *args: str, **kw) -> str:
    out = _run(tmp_path, *args, **kw)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the CUDA choice is Linux's (macOS -> metal)")


def test_no_nvidia_smi_is_cpu(tmp_path):
    assert _choice(tmp_path) == "cpu"


def test_gpu_with_a_cuda13_driver_is_cuda13(tmp_path):
    assert _choice(tmp_path, gpu=_fake_smi(tmp_path, "13.0")) == "cuda13"


def test_gpu_with_a_cuda12_driver_is_cuda12(tmp_path):
    assert _choice(tmp_path, gpu=_fake_smi(tmp_path, "12.4")) == "cuda12"


def test_gpu_whose_driver_cuda_version_is_unreadable_is_cuda12(tmp_path):
    assert _choice(tmp_path, gpu=_fake_smi(tmp_path, None)) == "cuda12"


def test_nvidia_smi_that_fails_is_cpu(tmp_path):
    assert _choice(tmp_path, gpu=_fake_smi(tmp_path, fails=True)) == "cpu"


def test_explain_names_the_gpu_the_choice_and_the_override(tmp_path):
    line = _choice(tmp_path, "--explain", gpu=_fake_smi(tmp_path, "13.0"))
    assert line.startswith("mlx-lane: MLX backend cuda13 ")
    assert "NVIDIA H200" in line and "CUDA 13" in line and "MLX_BACKEND=cpu|cuda" in line


@pytest.mark.parametrize(("backend", "cuda", "want"), [
    ("cpu", "13.0", "cpu"),  # a GPU, but the user asked for the CPU
    ("cuda", None, "cuda12"),  # no GPU visible (e.g. docker build): mlx's own `cuda` default
    ("cuda", "13.0", "cuda13"),
    ("cuda12", "13.0", "cuda12"),
    ("cuda13", None, "cuda13"),
])
def test_mlx_backend_overrides(tmp_path, backend, cuda, want):
    gpu = _fake_smi(tmp_path, cuda) if cuda else None
    assert _choice(tmp_path, gpu=gpu, backend=backend) == want


def test_unknown_mlx_backend_is_an_error_naming_the_choices(tmp_path):
    out = _run(tmp_path, backend="rocm")
    assert out.returncode == 2
    assert out.stdout == ""
    assert "cpu, cuda, cuda12, cuda13" in out.stderr


def test_every_choice_is_a_pyproject_extra():
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra, package in (("cpu", "mlx[cpu]"), ("cuda12", "mlx[cuda12]"), ("cuda13", "mlx[cuda13]")):
        assert any(req.startswith(package) for req in extras[extra]), (extra, extras.get(extra))
    assert "metal" in extras


@pytest.mark.parametrize(("cuda", "backend", "extras"), [
    ("13.0", None, "test,cuda13"),
    ("13.0", "cpu", "test,cpu"),
    (None, None, "test,cpu"),
])
def test_make_venv_installs_the_chosen_backend(tmp_path, cuda, backend, extras):
    """`make -n venv` into a fresh venv dir: the install line carries the chosen extra and the choice is said."""
    gpu = _fake_smi(tmp_path, cuda) if cuda else None
    out = _run(tmp_path, gpu=gpu, backend=backend, extra_tools=("make",),
               cmd=["make", "-n", "venv", f"VENV={tmp_path / 'venv'}"])
    assert out.returncode == 0, out.stderr
    assert f"pip install -q -e '.[{extras}]'" in out.stdout
    assert "sh deploy/mlx_backend.sh --explain" in out.stdout
    assert f"touch {tmp_path / 'venv'}/.installed-{extras.split(',')[1]}" in out.stdout
