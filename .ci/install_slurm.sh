#!/usr/bin/env bash
# Slurm and munge for the Slurm tests (tests/training/test_slurm.py starts its own single-node cluster from them), and
# iproute2 for the two-node cluster of tests/training/test_slurm_multinode.py (network namespaces, veth pairs, a bridge).
# Idempotent: does nothing when they are installed; needs root (or sudo) and Debian/Ubuntu's apt. Where neither
# is available it says so and exits 0, and the Slurm tests skip with that reason.
set -euo pipefail
need=()
packages=()
for bin in sbatch slurmctld slurmd munged mungekey; do
    command -v "$bin" >/dev/null 2>&1 || [[ -x "/usr/sbin/$bin" ]] || need+=("$bin")
done
[[ ${#need[@]} -eq 0 ]] || packages+=(slurm-wlm munge)
command -v ip >/dev/null 2>&1 || [[ -x /usr/sbin/ip ]] || { need+=(ip); packages+=(iproute2); }
for bin in nsenter unshare; do
    command -v "$bin" >/dev/null 2>&1 || { need+=("$bin"); packages+=(util-linux); }
done
if [[ ${#need[@]} -eq 0 ]]; then
    echo "slurm, munge and iproute2 already installed"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "no apt-get: install ${packages[*]} by hand to run tests/training/test_slurm*.py (missing: ${need[*]})" >&2
    exit 0
fi
SUDO=""
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo"
    else
        echo "not root and no sudo: cannot install ${packages[*]} (missing: ${need[*]})" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# shellcheck disable=SC2046  # one package name per word; util-linux may be listed twice
$SUDO apt-get install -y -q --no-install-recommends $(printf '%s\n' "${packages[@]}" | sort -u)
echo "installed: $(slurmctld -V 2>/dev/null || /usr/sbin/slurmctld -V), munge $(munged -V 2>/dev/null | head -1)," \
     "$(ip -V 2>/dev/null || /usr/sbin/ip -V)"
