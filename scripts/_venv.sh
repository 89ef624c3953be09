# Sourced by train.sh, test.sh and gpu_check.sh: create or reuse .venv and activate it. The
# caller's shell options are restored at the end, so sourcing it by hand leaves no `set -e` behind.
#
# Which torch (VEOMNI_TORCH):
#   pinned  torch==2.13.0 from the package index goes in first and is pinned through a
#           constraints file, so no later requirement can pull a different (multi-GB CUDA) build.
#   system  the torch $PYTHON already has (a GPU image's CUDA build, a cluster module), any of
#           torch 2.11 to 2.15 (pyproject.toml's range, read by _deps.py): the venv sees $PYTHON's
#           packages and installs only what is missing, from VEOMNI_WHEELS (a folder of wheels, no
#           network) when set, else from the index.
#   auto    (default) system when $PYTHON already imports a CUDA torch in that range, else pinned.
# (Shell options are recorded here, not through $(set +o): a command substitution runs without errexit.)
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

# auto is decided once, when the venv is made (it imports torch, ~2 s); later launches reuse the choice.
MADE_FOR="$(cat "$VENV/.veomni-torch" 2>/dev/null || { [ -x "$VENV/bin/python" ] && echo pinned; } || true)"
TORCH_MODE="${VEOMNI_TORCH:-${MADE_FOR:-auto}}"
if [ "$TORCH_MODE" != "$MADE_FOR" ]; then  # no venv yet, or one made for another torch
    case "$TORCH_MODE" in
        auto)
            if "$PYTHON" "$REPO_ROOT/scripts/_deps.py" --cuda >/dev/null 2>&1; then TORCH_MODE=system
            else TORCH_MODE=pinned; fi ;;
        system)
            "$PYTHON" "$REPO_ROOT/scripts/_deps.py" >&2 || {
                echo "[venv] VEOMNI_TORCH=system: $PYTHON has no torch this project supports (see above)" >&2
                exit 2; } ;;
        pinned) ;;
        *) echo "[venv] VEOMNI_TORCH=$TORCH_MODE: use auto, system or pinned" >&2; exit 2 ;;
    esac
    # A venv made for the other torch is made again (its packages would shadow or miss the right ones).
    if [ -n "$MADE_FOR" ] && [ "$MADE_FOR" != "$TORCH_MODE" ]; then
        echo "[venv] $VENV was made for the $MADE_FOR torch; making it again for the $TORCH_MODE one" >&2
        rm -rf "$VENV"
    fi
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "[venv] creating $VENV ($TORCH_MODE torch)" >&2
    if [ "$TORCH_MODE" = system ]; then
        # No pip of its own (ensurepip costs seconds): $PYTHON's, seen through the .pth, installs here.
        "$PYTHON" -m venv --system-site-packages --without-pip "$VENV"
        # $PYTHON may itself be a venv (GPU images often are), whose packages --system-site-packages
        # does not reach: name its site-packages in a .pth file.
        "$PYTHON" -c "import site; print('\n'.join(site.getsitepackages()))" \
            > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/veomni-system-torch.pth"
    else
        "$PYTHON" -m venv "$VENV"
    fi
    echo "$TORCH_MODE" > "$VENV/.veomni-torch"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

# The stamp holds a hash of pyproject.toml: a changed dependency list reinstalls, a mere newer
# file time (a fresh git worktree sharing this venv through VEOMNI_VENV) does not.
WANT="$(sha256sum "$REPO_ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    constraints="$VENV/torch-constraint.txt"
    # The installed distribution's version, which pip compares with: torch.__version__ may differ from
    # it (torch 2.14.1's CUDA wheel says 2.14.1+cu130, its metadata 2.14.1), and a pin pip's view of
    # the installed torch cannot meet fails every later install.
    TORCH_PIN="import importlib.metadata as m; print('torch==' + m.version('torch'))"
    if [ "$TORCH_MODE" = pinned ]; then
        echo "[venv] installing torch==2.13.0, then the project (one-time, ~2 min)" >&2
        python -m pip install --quiet --upgrade pip >&2
        python -m pip install --quiet "torch==2.13.0" >&2
        python -c "$TORCH_PIN" > "$constraints"
        python -m pip install --quiet -c "$constraints" -e "$REPO_ROOT[dev]" >&2
    else
        python -c "$TORCH_PIN" > "$constraints"
        echo "[venv] using $(python -c 'import torch; print("torch", torch.__version__, "from", torch.__file__)')" >&2
        # The project itself is on PYTHONPATH (below): only the dependencies it lacks are installed,
        # from VEOMNI_WHEELS when set; one that cannot be had (offline, not among the wheels) is
        # reported, and is fatal only if the engine imports it on every run.
        unmet="$(python "$REPO_ROOT/scripts/_deps.py" --unmet "$REPO_ROOT/pyproject.toml")"
        if [ -n "$unmet" ]; then
            from_wheels=()
            [ -n "${VEOMNI_WHEELS:-}" ] && from_wheels=(--no-index --find-links "$VEOMNI_WHEELS")
            echo "[venv] installing $(echo $unmet)${VEOMNI_WHEELS:+ from $VEOMNI_WHEELS}" >&2
            echo "$unmet" | xargs python -m pip install --quiet -c "$constraints" "${from_wheels[@]}" >&2 \
                || echo "[venv] some could not be installed; checking what the engine needs" >&2
        fi
        python "$REPO_ROOT/scripts/_deps.py" --check-imports "$REPO_ROOT/pyproject.toml" >&2
    fi
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
