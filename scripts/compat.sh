#!/usr/bin/env bash
# The whole test suite at one end of the declared torch and transformers ranges (or under a torch of
# your choice), in a throwaway venv of its own: the check behind the ranges that pyproject.toml and
# dflash/train/versions.py declare. A range is widened only after this passed on the new release.
#
#   make compat                                      # both ends: lowest, then newest
#   bash scripts/compat.sh lowest [pytest args]      # torch and transformers at the ranges' lower bounds,
#                                                    #   Python 3.12 (the lent GPU machine's stack)
#   bash scripts/compat.sh newest [pytest args]      # the newest releases inside the ranges, as a fresh
#                                                    #   install takes them; this machine's Python
#   bash scripts/compat.sh 2.12.0 [pytest args]      # another torch (TRANSFORMERS=5.20.0 pins transformers)
#   PYTHON=python3.11 bash scripts/compat.sh ...     # another interpreter
#
# The venv lands in .compat/<name>/ (ignored) and is reused by a later run; the suite's log and its
# closing counts line in .compat/<name>.log and .summary, and the versions it ran under in
# .compat/<name>.versions. torch's PyPI wheel for Linux is a CUDA build; it runs on a machine without a
# GPU. Not part of CI: each end runs the suite once more (~12 min on 2 cores). The project is installed
# without its dependencies, so a torch or transformers outside the declared range can be tried before
# the range is widened (pip would otherwise replace it).
set -euo pipefail
cd "$(dirname "$0")/.."

END=${1:-}
if [ -z "$END" ]; then
    echo "usage: scripts/compat.sh lowest|newest|TORCH_VERSION [pytest args...]" >&2
    exit 2
fi
shift

# The declared ranges, read from pyproject.toml: "lo hi" for torch, then for transformers.
read -r TORCH_LO TORCH_HI TF_LO TF_HI < <(python3 - <<'EOF'
import re
import tomllib

deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
bounds = []
for name in ("torch", "transformers"):
    spec = next(d for d in deps if re.match(rf"{name}\s*[<>=]", d))
    bounds += [re.search(r">=\s*([\d.]+)", spec).group(1), re.search(r"<\s*([\d.]+)", spec).group(1)]
print(*bounds)
EOF
)

case "$END" in
    lowest)
        TORCH=$TORCH_LO.0 TRANSFORMERS=$TF_LO.0
        source scripts/_python312.sh
        PINS=("torch==$TORCH" "transformers==$TRANSFORMERS") ;;
    newest)
        TORCH=newest TRANSFORMERS=newest
        PYTHON=${PYTHON:-python3}
        PINS=("torch>=$TORCH_LO,<$TORCH_HI" "transformers>=$TF_LO,<$TF_HI") ;;
    *)
        TORCH=$END TRANSFORMERS=${TRANSFORMERS:-}
        source scripts/_python312.sh
        PINS=("torch==$TORCH")
        if [ -n "$TRANSFORMERS" ]; then PINS+=("transformers==$TRANSFORMERS"); fi ;;
esac

case "$END" in
    lowest | newest) NAME=$END ;;
    *) NAME=torch-$TORCH${TRANSFORMERS:+-tf$TRANSFORMERS} ;;
esac
VENV=.compat/$NAME
BIN=$VENV/bin
mkdir -p .compat
if [ ! -f "$VENV/.installed" ] || [ pyproject.toml -nt "$VENV/.installed" ]; then
    test -x "$BIN/python" || "$PYTHON" -m venv "$VENV"  # (a venv left half-made is completed)
    "$BIN/pip" install -q --upgrade pip
    printf '%s\n' "${PINS[@]}" > "$VENV/constraints.txt"
    # every dependency and test extra of pyproject.toml but torch and transformers, under the pins above
    "$BIN/python" - > "$VENV/requirements.txt" <<'EOF'
import re
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["test"]:
    if re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower() not in ("torch", "transformers"):
        print(req)
EOF
    "$BIN/pip" install -q -c "$VENV/constraints.txt" "${PINS[@]}" -r "$VENV/requirements.txt"
    "$BIN/pip" install -q --no-deps -e .
    touch "$VENV/.installed"
fi
"$BIN/python" -c 'import sys, torch, transformers
print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}")' \
    | tee ".compat/$NAME.versions"

# One intra-op thread, as `make test`; niced: the suite shares this machine with other work.
set +e
OMP_NUM_THREADS=1 nice -n 10 "$BIN/python" -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee ".compat/$NAME.log"
rc=${PIPESTATUS[0]}
set -e
tail -n 1 ".compat/$NAME.log" > ".compat/$NAME.summary"
echo "compat: $NAME ($(cat ".compat/$NAME.versions")): $(cat ".compat/$NAME.summary") (log: .compat/$NAME.log)"
exit "$rc"
