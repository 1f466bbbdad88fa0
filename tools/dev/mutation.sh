#!/usr/bin/env bash
# Mutation testing of afd-protocol's core and window endpoints with mutmut (`make mutation`).
# Not part of `make test`: it takes tens of minutes on a 2-core machine. Prints the kill rate
# and every surviving mutant; the configuration is [tool.mutmut] in
# packages/afd-protocol/pyproject.toml. Runs in its own venv (the package is not installed
# there, so the tests import the mutated copy).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$(pwd)
venv=$root/build/mutation-venv
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/mutmut" ]; then
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet "${TORCH_SPEC:-torch==2.13.0}" "mutmut==3.8.1" \
    "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
fi
cd packages/afd-protocol
rm -rf mutants
# One torch thread: mutmut forks a child per mutant, and a fork after torch started its
# thread pool can deadlock.
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$venv/bin/mutmut" run --max-children "${MUTATION_JOBS:-2}" || true
"$venv/bin/python" "$root/tools/dev/mutation_report.py" "$venv/bin/mutmut"
