# Shared by packaging/ scripts: install what is missing, into the system (apt) or the
# project's virtual environment (.venv). Source it; it defines functions only.

DSSTAGE_TOP=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DSSTAGE_VENV=${DSSTAGE_VENV:-$DSSTAGE_TOP/.venv}

# dsstage_version: dsstage.__version__ of this checkout, read from its source
dsstage_version() {
    sed -n 's/^__version__ = "\(.*\)"$/\1/p' "$DSSTAGE_TOP/lib/dsstage/__init__.py"
}

# ensure_apt PKG...: apt-get install the packages that are not installed yet.
ensure_apt() {
    local missing=() pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    ((${#missing[@]})) || return 0
    if [ "$(id -u)" != 0 ]; then
        echo "dsstage: need root to install: ${missing[*]}" >&2
        return 1
    fi
    echo "dsstage: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

# ensure_native: native/dsstage-copy, the verifying copier's C helper for small files
# (dsstage.transfer.native), built against Debian's BLAKE3 C sources (librust-blake3-dev).
ensure_native() {
    ensure_apt gcc make libc6-dev librust-blake3-dev
    make -s -C "$DSSTAGE_TOP/native" >&2
}

# ensure_venv [EXTRAS]: a virtual environment with dsstage installed (editable), and the
# native copier built beside it.
ensure_venv() {
    local extras=${1:-}
    ensure_native || echo "dsstage: the native copier is not built (native/): dsstage copies in Python" >&2
    [ -x "$DSSTAGE_VENV/bin/python" ] || python3 -m venv "$DSSTAGE_VENV"
    "$DSSTAGE_VENV/bin/python" -m pip install -q --disable-pip-version-check \
        -e "$DSSTAGE_TOP${extras:+[$extras]}" 2>&1 | grep -v "^WARNING: Location" >&2 || true
    "$DSSTAGE_VENV/bin/python" -c "import dsstage" || { echo "dsstage: venv install failed" >&2; return 1; }
}
