#!/usr/bin/env bash
# The server's stack (fastapi, uvicorn) and the benchmark's client (httpx) for the GPU machine, which reaches no
# package registry: the wheels travel with the working tree in wheels/serve/ (ignored by git; name `wheels` in the
# device call's carry list; ~4 MiB) and are installed there before `gpu_stages.sh serve` (and the tests stage, for
# tests/test_serve.py).
#
#   here, once:   bash benchmarks/serve_wheels.sh fetch      # -> wheels/serve/*.whl (CPython 3.12, x86-64 Linux)
#   there:        bash benchmarks/serve_wheels.sh install
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-install} in
  fetch)
    mkdir -p wheels/serve
    python3 -m pip download -q --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --python-version 3.12 -d wheels/serve fastapi uvicorn httpx
    ls wheels/serve ;;
  install)
    if ! ls wheels/serve/*.whl > /dev/null 2>&1; then
      echo "no wheels/serve: run 'bash benchmarks/serve_wheels.sh fetch' here and carry wheels/" >&2; exit 1
    fi
    python3 -m pip install -q --no-index --find-links wheels/serve fastapi uvicorn httpx
    python3 -c "import fastapi, uvicorn, httpx; print('fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)" ;;
  *) echo "usage: $0 fetch|install" >&2; exit 2 ;;
esac
