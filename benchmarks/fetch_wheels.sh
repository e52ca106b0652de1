#!/usr/bin/env bash
# Download into .whl/ the wheels a lent GPU machine (Python 3.12, no network)
# needs beside its jax: beartype, and tokamax with its dependencies for the
# peer rows. Run on this machine before a device call that carries .whl/
# (benchmarks/gpu_session.sh and benchmarks/gpu_backlog.py install them).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  beartype jaxtyping wadler-lindig tokamax xprof pydantic pydantic-core annotated-types \
  typing-inspection typing_extensions qwix einshape immutabledict tensorboardx fire termcolor \
  gviz-api
du -sh .whl
