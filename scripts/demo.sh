#!/usr/bin/env bash
# Set everything up and run the demo on 2 MPI ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m mpidag.run -n 2 examples/demo.py
