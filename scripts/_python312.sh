# Sourced by scripts/compat.sh and scripts/device_dryrun.sh: sets PYTHON to a Python 3.12 (the lent GPU
# machine's) unless the caller set one: python3.12 on PATH, else pyenv's (its shim fails when 3.12 is
# not the selected version).
if [ -z "${PYTHON:-}" ]; then
    pyenv_root=$(pyenv root 2>/dev/null || echo /nonexistent)
    for candidate in python3.12 "$pyenv_root"/versions/3.12*/bin/python3.12; do
        if "$candidate" -c 'import sys' 2>/dev/null; then PYTHON=$candidate; break; fi
    done
fi
if [ -z "${PYTHON:-}" ]; then
    echo "no Python 3.12 found; set PYTHON=/path/to/python3.12" >&2
    exit 2
fi
