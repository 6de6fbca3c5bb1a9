#!/usr/bin/env bash
# A newer transformers for the GPU machine, whose image holds an older one (the issues ask for runs under both). That
# machine reaches no package registry, so the wheels travel with the working tree in wheels/tf/ (ignored by git; name
# `wheels/tf` in the device call's carry list, ~32 MiB) and are installed there into wheels/tf/site, a folder that
# gpu_stages.sh puts first on PYTHONPATH when TRANSFORMERS=newest (the image's own packages stay as they are).
#
#   here, once:   bash benchmarks/tf_wheels.sh fetch [VERSION]   # transformers and what it needs (CPython 3.12,
#                                                                # x86-64 Linux; numpy left out: the image's serves)
#   there:        TRANSFORMERS=newest OUT=... bash benchmarks/gpu_stages.sh cbgraphs   # installs, then runs
#                 (or by hand: bash benchmarks/tf_wheels.sh install; export PYTHONPATH=$PWD/wheels/tf/site:$PYTHONPATH)
#
# install puts into wheels/tf/site only the wheels whose distribution the machine lacks or holds in an older version
# (--no-deps, --no-index), then imports transformers from there and prints its version.
set -euo pipefail
cd "$(dirname "$0")/.."
case ${1:-install} in
  fetch)
    version=${2:-$(python3 -c "import transformers; print(transformers.__version__)")}
    rm -rf wheels/tf && mkdir -p wheels/tf
    python3 -m pip download -q --only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux_2_28_x86_64 --python-version "${PYTHON_VERSION:-3.12}" -d wheels/tf "transformers==$version"
    rm -f wheels/tf/numpy-*.whl
    du -sh wheels/tf ;;
  install)
    if ! ls wheels/tf/transformers-*.whl > /dev/null 2>&1; then
      echo "no wheels/tf: run 'bash benchmarks/tf_wheels.sh fetch' here and carry wheels/tf" >&2; exit 1
    fi
    wanted=$(python3 - <<'PY'
import glob, importlib.metadata as md, os
from packaging.version import Version
for path in sorted(glob.glob("wheels/tf/*.whl")):
    name, version = os.path.basename(path).split("-")[:2]
    try:
        have = md.version(name.replace("_", "-"))
    except md.PackageNotFoundError:
        have = None
    if have is None or Version(have) < Version(version):
        print(path)
PY
)
    rm -rf wheels/tf/site
    # shellcheck disable=SC2086
    python3 -m pip install -q --no-deps --no-index --target wheels/tf/site $wanted
    PYTHONPATH="$PWD/wheels/tf/site${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
      "import transformers, huggingface_hub; print('transformers', transformers.__version__, 'from', transformers.__file__)" ;;
  *) echo "usage: $0 fetch [VERSION] | install" >&2; exit 2 ;;
esac
