"""The install path (scripts/setup.sh picks the CUDA 12 or the CPU build of the pinned jax) and the GPU-only tests,
which are skipped without a GPU (``nvidia-smi -L`` fails): the main job and a 2-stage VW with ``platform=gpu``."""

import json
import os
import pathlib
import shutil
import subprocess

import pytest

from hetpipe_jax.paths import REPO_ROOT
from tests.mpi_util import run_job

SETUP = str(REPO_ROOT / "scripts" / "setup.sh")


def _detect(tmp_path, nvidia_smi: str | None, build: str | None = None):
  """Runs setup.sh's detection only (SETUP_DETECT_ONLY=1: installs nothing) with a fake ``nvidia-smi`` on PATH."""
  env = {k: v for k, v in os.environ.items() if k != "HETPIPE_JAX_BUILD"}
  fake = tmp_path / "bin"
  fake.mkdir(parents=True, exist_ok=True)
  if nvidia_smi is not None:
    (fake / "nvidia-smi").write_text(f"#!/bin/sh\n{nvidia_smi}\n")
    (fake / "nvidia-smi").chmod(0o755)
  # PATH without any real nvidia-smi: the fake folder plus the folders of the tools the script needs
  tools = {str(pathlib.Path(shutil.which(t)).parent) for t in ("sed", "sha256sum", "cut", "python3", "bash")}
  env["PATH"] = os.pathsep.join([str(fake), *sorted(tools)])
  env["SETUP_DETECT_ONLY"] = "1"
  if build is not None:
    env["HETPIPE_JAX_BUILD"] = build
  return subprocess.run(["bash", SETUP], env=env, capture_output=True, text=True, timeout=60)


def test_setup_picks_the_cuda_build_only_when_nvidia_smi_finds_a_gpu(tmp_path):
  pinned = next(line.split("==")[1] for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()
                if line.startswith("jax=="))
  gpu = _detect(tmp_path, 'echo "GPU 0: NVIDIA H100 (UUID: GPU-x)"')
  assert gpu.returncode == 0 and f"jax {pinned}, CUDA 12 build, jax[cuda12]=={pinned}" in gpu.stdout, gpu
  for smi in (None, "exit 9"):  # no nvidia-smi, or one that finds no GPU / no driver
    cpu = _detect(tmp_path / str(smi is None), smi)
    assert cpu.returncode == 0 and f"jax {pinned}, CPU build" in cpu.stdout, cpu
  forced = _detect(tmp_path, 'echo "GPU 0"', build="cpu")
  assert "CPU build" in forced.stdout and "HETPIPE_JAX_BUILD=cpu" in forced.stdout
  bad = _detect(tmp_path, None, build="rocm")
  assert bad.returncode != 0 and "HETPIPE_JAX_BUILD=rocm must be cpu or cuda12" in bad.stderr


def test_setup_keeps_the_cpu_stamp_of_existing_venvs():
  """The CPU build's install stamp is the plain requirements hash, as before: existing CPU venvs are not reinstalled."""
  text = pathlib.Path(SETUP).read_text()
  assert 'want=$(sha256sum requirements.txt | cut -d\' \' -f1)\n[ "$build" = cuda12 ] && want="$want cuda12"' in text
  assert 'pip install --quiet "jax[cuda12]==$jax_version"' in text


def _has_gpu() -> bool:
  smi = shutil.which("nvidia-smi")
  return smi is not None and subprocess.run([smi, "-L"], capture_output=True, check=False).returncode == 0


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(not _has_gpu(), reason="needs an NVIDIA GPU (nvidia-smi -L)")
def test_gpu_two_stage_vw_runs(tmp_path, synthetic_data_dir):
  """platform=gpu: 1 PS + 2 VWs of 2 stages (both stages on GPU 0 when there is one GPU)."""
  workdir = tmp_path / "run"
  count = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False).stdout.count("GPU ")
  proc = run_job(workdir, 3, {"data_dir": synthetic_data_dir, "platform": "gpu", "num_minibatches": 16,
                              "stage_devices": "0,1" if count >= 2 else "0,0"})
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["num_stages"] == 2 and summary["num_minibatches"] == 32 and summary["test_accuracy"] > 0
