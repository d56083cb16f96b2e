#!/usr/bin/env bash
# Installs this checkout, editable and with its test extras, into the venv given as $1.
# setuptools writes hisparse_triton.egg-info into the checkout, so venvs built at the same
# time take turns here (flock on .ci-logs/install.lock).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .ci-logs
flock .ci-logs/install.lock "$1/bin/pip" install --quiet -e '.[test]'
