#!/usr/bin/env bash
# bitsandbytes for the GPU machine (QLoRA tests, tests/test_bnb.py). That machine reaches no package registry, so the
# wheel travels with the working tree: it lives in wheels/ (ignored by git, so the device call must name `wheels` in
# its carry list; the wheel is ~41 MiB of the 64 MiB a call may carry) and is installed there before the tests.
#
#   here, once:   bash benchmarks/bnb_wheel.sh fetch     # -> wheels/bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl
#   there:        bash benchmarks/bnb_wheel.sh install && python3 -m pytest tests/test_bnb.py -m gpu
#                 (or prefix any test run with it: `bash benchmarks/bnb_wheel.sh install && bash benchmarks/gpu_stages.sh tests`)
#
# The wheel is pure-Python tagged (py3-none) with bitsandbytes' CPU and CUDA libraries inside, so one file serves the
# GPU machine's Python 3.12 / CUDA 13 torch and this machine alike. --no-deps: its requirements (torch, numpy,
# packaging) are already in the GPU image. pyproject's `bnb` extra asks for >=0.50.2, the version CI proves.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${BNB_VERSION:-0.50.2}
WHEEL=wheels/bitsandbytes-$VERSION-py3-none-manylinux_2_24_x86_64.whl
case ${1:-install} in
  fetch)
    mkdir -p wheels
    if [ -f "$WHEEL" ]; then echo "$WHEEL already there"; exit 0; fi
    python3 -m pip download --no-deps --only-binary=:all: --platform manylinux_2_24_x86_64 --python-version 3.12 \
      -d wheels "bitsandbytes==$VERSION"
    ls -l "$WHEEL" ;;
  install)
    if [ ! -f "$WHEEL" ]; then echo "no $WHEEL: run 'bash benchmarks/bnb_wheel.sh fetch' here and carry wheels/" >&2; exit 1; fi
    python3 -m pip install -q --no-deps --no-index "$WHEEL"
    python3 -c "import bitsandbytes, torch; print('bitsandbytes', bitsandbytes.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())" ;;
  *) echo "usage: $0 fetch|install" >&2; exit 2 ;;
esac
