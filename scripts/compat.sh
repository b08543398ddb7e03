#!/usr/bin/env bash
# The whole test suite under another torch, in a throwaway venv of its own: the check behind the torch
# range that pyproject.toml and dflash/train/versions.py declare.
#
#   make compat TORCH=2.11.0                        # or: bash scripts/compat.sh 2.11.0 [pytest args]
#   make compat TORCH=2.11.0 TRANSFORMERS=5.17.0    # pin transformers too (the lent GPU machine's)
#   PYTHON=python3.11 bash scripts/compat.sh 2.11.0 # another interpreter (default: Python 3.12)
#
# The venv lands in .compat/torch-<version>[-tf<version>]/ (ignored) and is reused by a later run; the
# suite's log and its closing counts line in .compat/<same name>.log and .summary. torch's PyPI wheel
# for Linux is a CUDA build; it runs on a machine without a GPU. Not part of CI: it installs a second
# torch (~1 GB with its CUDA libraries) and runs the suite a second time (~15 min on 2 cores).
# The project itself is installed without its dependencies and those beside it, so a torch outside
# the declared range can be tried before the range is widened (pip would otherwise replace it).
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=${1:-}
if [ -z "$TORCH" ]; then
    echo "usage: scripts/compat.sh TORCH_VERSION [pytest args...]  (e.g. 2.11.0)" >&2
    exit 2
fi
shift
TRANSFORMERS=${TRANSFORMERS:-}

source scripts/_python312.sh

NAME=torch-$TORCH${TRANSFORMERS:+-tf$TRANSFORMERS}
VENV=.compat/$NAME
BIN=$VENV/bin
mkdir -p .compat
if [ ! -f "$VENV/.installed" ]; then
    test -x "$BIN/python" || "$PYTHON" -m venv "$VENV"  # (a venv left half-made is completed)
    "$BIN/pip" install -q --upgrade pip
    {
        echo "torch==$TORCH"
        if [ -n "$TRANSFORMERS" ]; then echo "transformers==$TRANSFORMERS"; fi
    } > "$VENV/constraints.txt"
    # every dependency and test extra of pyproject.toml but torch, under the constraints above
    "$BIN/python" - > "$VENV/requirements.txt" <<'EOF'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["test"]:
    if re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower() != "torch":
        print(req)
EOF
    "$BIN/pip" install -q -c "$VENV/constraints.txt" "torch==$TORCH" -r "$VENV/requirements.txt"
    "$BIN/pip" install -q --no-deps -e .
    touch "$VENV/.installed"
fi
"$BIN/python" -c 'import sys, torch, transformers
print(f"compat: Python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}")'

# One intra-op thread, as `make test`; niced: the suite shares this machine with other work.
set +e
OMP_NUM_THREADS=1 nice -n 10 "$BIN/python" -m pytest -q -p no:cacheprovider "$@" 2>&1 \
    | tee ".compat/$NAME.log"
rc=${PIPESTATUS[0]}
set -e
tail -n 1 ".compat/$NAME.log" > ".compat/$NAME.summary"
echo "compat: torch $TORCH: $(cat ".compat/$NAME.summary") (log: .compat/$NAME.log)"
exit "$rc"
