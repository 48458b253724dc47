#!/usr/bin/env bash
# Runs the Python package's tests against the ckptd binary and the package Bazel built (both
# in this test's runfiles), with one of the two supported PyTorch lines:
#   run_pytest.sh debian   Debian 12's /usr/bin/python3 and python3-torch (1.13)
#   run_pytest.sh torch2   the project's virtual environment ($CKPTD_PYTHON, made by
#                          tools/setup.sh), which holds PyTorch 2 from PyPI
# Further arguments go to pytest: test files to run (all of client/python/tests when none is
# named) or options such as --ignore, so that one suite can be split into targets that each
# stay well inside Bazel's timeout.
set -euo pipefail
flavour=${1:?usage: run_pytest.sh debian|torch2 [pytest args]}
shift
cd "${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-ckptd}"
export PYTHONPATH="$PWD/client/python"
export CKPTD_BIN="$PWD/daemon/ckptd"
export CKPTCTL_BIN="$PWD/client/ckptctl"
extra=()
case $flavour in
  # What only PyTorch 2 has (torch.compile, DTensor, FSDP2, FSDP1 on Python 3.11) is not
  # collected on 1.13.
  # Nor what needs `transformers`, `accelerate`, `lightning`, `torchtitan`, `torchdata`,
  # `prometheus_client` or `kubernetes-validate` (the virtual environment's).
  debian) python=/usr/bin/python3; export CKPTD_WALKTHROUGH_RUNS=1; extra=(--ignore=client/python/tests/test_torch2.py
                                          --ignore=client/python/tests/test_fsdp1.py
                                          --ignore=client/python/tests/test_user_view.py
                                          --ignore=client/python/tests/test_lightning.py
                                          --ignore=client/python/tests/test_torchtitan.py
                                          --ignore=client/python/tests/test_hf_trainer.py
                                          --ignore=client/python/tests/test_accelerate.py
                                          --ignore=client/python/tests/test_dcp_real_models.py
                                          --ignore=client/python/tests/test_from_dcp.py
                                          --ignore=client/python/tests/test_increment_read.py
                                          --ignore=client/python/tests/test_docs_python.py
                                          --ignore=client/python/tests/test_dataloader_resume.py
                                          --ignore=client/python/tests/test_metrics.py
                                          --ignore=client/python/tests/test_kubernetes.py) ;;
  torch2)
    python=${CKPTD_PYTHON:-}
    if [ -z "$python" ] || [ ! -x "$python" ]; then
      echo "CKPTD_PYTHON must name the virtual environment's python (tools/test.sh sets it:" \
           "--test_env=CKPTD_PYTHON=\$PWD/.venv/bin/python)" >&2
      exit 2
    fi
    # Never pass on the wrong PyTorch: this run exists to test PyTorch 2.
    "$python" -c 'import sys, torch; sys.exit(0 if int(torch.__version__.split(".")[0]) >= 2 else
                  f"expected PyTorch 2 in {sys.prefix}, found {torch.__version__}: run tools/setup.sh")'
    ;;
  *) echo "unknown flavour $flavour" >&2; exit 2 ;;
esac
files=()
for arg in "$@"; do
  case $arg in -*) extra+=("$arg") ;; *) files+=("$arg") ;; esac
done
[ ${#files[@]} -gt 0 ] || files=(client/python/tests)
# --durations: the slowest cases in the log, to split a target that nears its timeout.
exec "$python" -m pytest -p no:cacheprovider -q --durations=10 "${files[@]}" "${extra[@]}"
