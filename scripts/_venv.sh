# Sourced by train.sh and test.sh: create or reuse .venv and activate it. The caller's shell
# options are restored at the end, so sourcing it by hand leaves no `set -e` behind.
# torch==2.13.0 goes in first and is pinned through a constraints file, so no later
# requirement can pull a different (multi-GB CUDA) build over it.
# (Recorded here, not through $(set +o): a command substitution runs without errexit.)
_VEOMNI_FLAGS="$-"
if [[ -o pipefail ]]; then _VEOMNI_PIPEFAIL=1; else _VEOMNI_PIPEFAIL=0; fi
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VEOMNI_VENV:-$REPO_ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.veomni-installed"

# Two launches at once (e.g. two nodes' train.sh on one machine) must not both install.
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [ ! -x "$VENV/bin/python" ]; then
    echo "[venv] creating $VENV" >&2
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

# The stamp holds a hash of pyproject.toml: a changed dependency list reinstalls, a mere newer
# file time (a fresh git worktree sharing this venv through VEOMNI_VENV) does not.
WANT="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "[venv] installing torch==2.13.0, then the project (one-time, ~2 min)" >&2
    python -m pip install --quiet --upgrade pip >&2
    python -m pip install --quiet "torch==2.13.0" >&2
    constraints="$VENV/torch-constraint.txt"
    python -c "import torch; print('torch==' + torch.__version__)" > "$constraints"
    python -m pip install --quiet -c "$constraints" -e "$REPO_ROOT[dev]" >&2
    echo "$WANT" > "$STAMP"
fi
flock -u 9
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
export TRANSFORMERS_OFFLINE="${TRANSFORMERS_OFFLINE:-1}"
case "$_VEOMNI_FLAGS" in *e*) set -e ;; *) set +e ;; esac
case "$_VEOMNI_FLAGS" in *u*) set -u ;; *) set +u ;; esac
if [ "$_VEOMNI_PIPEFAIL" = 1 ]; then set -o pipefail; else set +o pipefail; fi
unset _VEOMNI_FLAGS _VEOMNI_PIPEFAIL
