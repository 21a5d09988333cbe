#!/usr/bin/env bash
# Slurm and munge for the Slurm tests (tests/test_slurm.py starts its own single-node cluster from them).
# Idempotent: does nothing when they are installed; needs root (or sudo) and Debian/Ubuntu's apt. Where neither
# is available it says so and exits 0, and the Slurm tests skip with that reason.
set -euo pipefail
need=()
for bin in sbatch slurmctld slurmd munged mungekey; do
    command -v "$bin" >/dev/null 2>&1 || [[ -x "/usr/sbin/$bin" ]] || need+=("$bin")
done
if [[ ${#need[@]} -eq 0 ]]; then
    echo "slurm and munge already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "no apt-get: install slurm-wlm and munge by hand to run tests/test_slurm.py (missing: ${need[*]})" >&2
    exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo"
    else
        echo "not root and no sudo: cannot install slurm-wlm and munge (missing: ${need[*]})" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends slurm-wlm munge
echo "installed: $(slurmctld -V 2>/dev/null || /usr/sbin/slurmctld -V), munge $(munged -V 2>/dev/null | head -1)"
