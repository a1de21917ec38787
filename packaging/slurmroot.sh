# A Debian root of another Slurm series, for packaging/devcluster (DEVCLUSTER_SLURM=24.11 or
# 26.05): Debian's own packages give three series, 22.05 on this Debian 12 (bookworm), 24.11
# in trixie and 26.05 in sid. A newer Debian's packages do not install here (newer libc),
# so the cluster runs in a root of that Debian, made once with debootstrap from the package
# registry apt uses and cached under $SLURM_ROOTS. Source it; it defines functions only.
#
# Nothing is mounted on this machine for it: every command runs in the root through
# bubblewrap (bwrap), which binds the cluster's directory, the checkout, /tmp and the users
# and groups of this machine at the same paths, for root (the daemons, as the systemd units
# would) and for ordinary users (sbatch, squeue, ...: the wrappers root_wrappers writes),
# so a cluster leaves nothing behind but its processes, stopped by pid.

SLURM_ROOTS=${DEVCLUSTER_ROOTS:-/var/cache/dsstage/slurm-roots}
#: what a root holds: Slurm and what dsstage's hooks and tests run in it
ROOT_PACKAGES=(slurmctld slurmd slurm-client libslurm-dev munge rsync lua5.1 gcc make libc6-dev
    python3-venv python3-dev ca-certificates procps)
#: the Python dsstage runs in a root (its own Python: 3.13 in trixie and sid)
ROOT_VENV=/opt/dsstage-venv

# series_suite SERIES: the Debian suite that packages it
series_suite() {
    case $1 in
        24.11) echo trixie ;;
        26.05) echo sid ;;
        *) return 1 ;;
    esac
}

# debian_mirror: the Debian archive apt uses on this machine
debian_mirror() {
    local uri
    uri=$(grep -hE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
        | grep -v security | grep -oE 'https?://[^ ]+' | head -n 1)
    echo "${uri:-http://deb.debian.org/debian}"
}

# root_ensure SERIES TOP: the root of SERIES (built once, then reused), with dsstage's
# dependencies in its venv; dies loudly when the series' packages cannot be fetched.
root_ensure() {
    local series=$1 top=$2 suite root stamp
    suite=$(series_suite "$series") || { echo "devcluster: no Debian suite packages Slurm $series" >&2; return 1; }
    root=$SLURM_ROOTS/$series
    stamp="$series $suite $(sha256sum "$top/pyproject.toml" | cut -c1-16) ${ROOT_PACKAGES[*]}"
    if [ "$(cat "$root/.dsstage-root" 2>/dev/null)" = "$stamp" ]; then
        echo "$root"
        return 0
    fi
    echo "devcluster: building a Debian $suite root for Slurm $series in $root (once)" >&2
    mkdir -p "$SLURM_ROOTS"
    rm -rf "$root.new"
    if ! debootstrap --variant=minbase "$suite" "$root.new" "$(debian_mirror)" >"$SLURM_ROOTS/$series.log" 2>&1; then
        echo "devcluster: cannot make a Debian $suite root from $(debian_mirror) (log: $SLURM_ROOTS/$series.log)" >&2
        return 1
    fi
    cp /etc/resolv.conf "$root.new/etc/resolv.conf" 2>/dev/null || true
    if ! _in_new_root "$root.new" bash -c "export DEBIAN_FRONTEND=noninteractive; apt-get update -qq &&
            apt-get install -y -qq --no-install-recommends ${ROOT_PACKAGES[*]} >/dev/null" \
            >>"$SLURM_ROOTS/$series.log" 2>&1; then
        echo "devcluster: cannot install Slurm $series from Debian $suite (log: $SLURM_ROOTS/$series.log)" >&2
        return 1
    fi
    # this machine's certificates (package registries behind a proxy), then the venv and
    # dsstage's dependencies from the checkout's pyproject.toml
    cp /etc/ssl/certs/ca-certificates.crt "$root.new/etc/ssl/certs/ca-certificates.crt" 2>/dev/null || true
    if ! _in_new_root "$root.new" bash -c "python3 -m venv $ROOT_VENV &&
            $ROOT_VENV/bin/pip install -q --disable-pip-version-check setuptools wheel &&
            $ROOT_VENV/bin/pip install -q --disable-pip-version-check -e '$top' &&
            $ROOT_VENV/bin/pip uninstall -q -y dsstage" >>"$SLURM_ROOTS/$series.log" 2>&1; then
        echo "devcluster: cannot install dsstage's dependencies in the $suite root (log: $SLURM_ROOTS/$series.log)" >&2
        return 1
    fi
    echo "$stamp" > "$root.new/.dsstage-root"
    rm -rf "$root"
    mv "$root.new" "$root"
    echo "$root"
}

# _in_new_root ROOT COMMAND...: as root, in a root being built (its own /proc, /dev; the
# checkout bound for pip)
_in_new_root() {
    local root=$1; shift
    bwrap --bind "$root" / --dev-bind /dev /dev --proc /proc --ro-bind /sys /sys --tmpfs /tmp \
        --bind "$DSSTAGE_TOP" "$DSSTAGE_TOP" --chdir / \
        /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LC_ALL=C.UTF-8 "$@"
}

# root_wrappers ROOT DIR TOP: $DIR/bin/in-root (run a command in the root, as whoever runs
# it) and, through it, Slurm's commands and dsstage as a login node of that series has them.
root_wrappers() {
    local root=$1 dir=$2 top=$3 cmd p
    # the mount points, which a user's bwrap cannot make, and every user may enter (in the
    # root: the checkout's own directories here keep their modes)
    mkdir -p "$dir/bin" "$root$dir" "$root$top"
    for p in "$dir" "$top"; do
        while [ "$p" != / ]; do chmod 0755 "$root$p"; p=$(dirname "$p"); done
    done
    cat > "$dir/bin/in-root" <<EOF
#!/bin/sh
# generated by packaging/devcluster: run a command in the Debian root of $root
# (bubblewrap; this cluster's directory, the checkout, /tmp, users and groups bound as here)
cwd=/
case \$PWD in $dir | $dir/* | $top | $top/* | /tmp | /tmp/*) cwd=\$PWD ;; esac
# the checkout (where the root's venv finds dsstage) for whoever may enter it here
top=
if [ -x $top ]; then top="--bind $top $top"; fi
exec bwrap --bind $root / --dev-bind /dev /dev --proc /proc --ro-bind /sys /sys --bind /tmp /tmp \\
    --bind $dir $dir \$top --ro-bind /etc/passwd /etc/passwd --ro-bind /etc/group /etc/group \\
    --ro-bind /etc/hosts /etc/hosts --chdir "\$cwd" \\
    /usr/bin/env PATH=$ROOT_VENV/bin:/usr/sbin:/usr/bin:/sbin:/bin "\$@"
EOF
    for cmd in sbatch srun salloc squeue scontrol sinfo scancel sacct sprio sattach sbcast sstat sshare \
        munge unmunge dsstage; do
        printf '#!/bin/sh\n# generated by packaging/devcluster: %s of the Slurm root %s\nexec %s %s "$@"\n' \
            "$cmd" "$root" "$dir/bin/in-root" "$cmd" > "$dir/bin/$cmd"
    done
    chmod 0755 "$dir/bin"/*
}
