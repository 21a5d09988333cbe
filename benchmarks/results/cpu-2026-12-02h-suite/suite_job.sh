set -uo pipefail
cd /work/ci-clone
. /work/main/.venv/bin/activate
export PYTHONPATH=/work/ci-clone PIP_DISABLE_PIP_VERSION_CHECK=1
date; uptime
lint-imports --no-cache; echo "lint-imports rc=$?"
ruff check persrag_lightning tests benchmarks slurm train.py; echo "ruff rc=$?"
site_dir="$(mktemp -d)"; NO_MKDOCS_2_WARNING=1 mkdocs build --strict --site-dir "$site_dir" > /work/ci-mkdocs.txt 2>&1; echo "mkdocs rc=$?"; rm -rf "$site_dir"
python -m pytest -q -m "not gpu" --timeout 1800 -p no:cacheprovider; echo "pytest rc=$?"
date; uptime
