#!/usr/bin/env bash
# Creates .venv (if missing) and installs rl-refit with everything its tests and demo use.
# Idempotent: a stamp records the pyproject.toml it installed from.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.rl-refit-installed"
want=$(sha256sum pyproject.toml scripts/setup-env.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# The CPU build of torch 2.13.0; any looser request would pull a multi-GB CUDA build.
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install -e ".[test,megatron,modelopt,fla,plot,docs]"
# megatron-core 0.19.2 declares Python >= 3.12, but its wheel runs on 3.11. Never install
# transformer-engine here: it cannot be built without CUDA and a half install breaks megatron.core.
"${pip[@]}" install --no-deps --ignore-requires-python "megatron-core==0.19.2"
echo "$want" > "$stamp"
