"""The peer daemon (``dsstage peers serve``): an rsync daemon per node serving the tiers'
``staging`` and ``datasets`` read-only to the other nodes' root, authenticated with the shared
secret; its configuration, private working directory and start.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping, Sequence

from dsstage.config.model import Config, Peers
from dsstage.errors import ConfigError
from dsstage.fs import safe

log = logging.getLogger(__name__)

#: the user name the daemons know the peers by (the secret is what authenticates)
USER = "dsstage"
#: the shortest secret accepted (rsync's challenge-response can be attacked offline)
MIN_SECRET = 32


def read_secret(path: str) -> str:
    """The shared secret: the first line of a regular file only root can read or write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"peers.secret_file {path}: cannot open ({exc.strerror}); create it on every node, "
                          "the same on all, mode 0600, owned by root") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o077:
            raise ConfigError(f"peers.secret_file {path}: must be a regular file owned by root that nobody else "
                              "can read or write (chown root: and chmod 0600 it)")
        text = os.read(fd, 4096).decode("utf-8", "replace")
    finally:
        os.close(fd)
    secret = text.splitlines()[0].strip() if text.strip() else ""
    if not secret or any(ord(c) < 32 for c in secret):
        raise ConfigError(f"peers.secret_file {path}: its first line must be the secret (printable, not empty)")
    if len(secret) < MIN_SECRET:
        raise ConfigError(f"peers.secret_file {path}: the secret has {len(secret)} characters; give at least "
                          f"{MIN_SECRET} random ones (e.g. head -c 24 /dev/urandom | base64): a daemon's challenge "
                          "can be answered offline for a short one")
    return secret


def modules(config: Config, node: str) -> dict[str, str]:
    """The daemon's modules on ``node``: ``<tier>-staging`` and ``<tier>-datasets`` -> path."""
    out = {}
    for tier in config.tiers.values():
        root = tier.root(node)
        out[f"{tier.name}-staging"] = os.path.join(root, "staging")
        out[f"{tier.name}-datasets"] = os.path.join(root, "datasets")
    return out


def daemon_config(config: Config, node: str, secrets_file: str, allow: Sequence[str] = (),
                  lock_file: str = "") -> str:
    """rsyncd.conf for ``node``: read-only, authenticated, only the tiers' data, only for the
    ``allow``ed addresses (the nodes'), at most ``peers.max_connections`` transfers at once
    (pure). rsync checks both once a client names a module: a connection that never does
    holds a forked daemon until it closes, bounded only by the unit's TasksMax."""
    if not allow:
        raise ConfigError("the peer daemon would accept anyone: set peers.allow (the nodes' addresses, or "
                          "their network as address/prefix), or peers.hosts")
    lines = [f"# dsstage peers serve: node {node}, from {config.origin}",
             "use chroot = yes", "read only = yes", "write only = no", "list = no",
             # the staging areas are root's only (0700); nothing is written
             "uid = root", "gid = root", "reverse lookup = no",
             f"hosts allow = {' '.join(allow)}", "hosts deny = *",
             f"max connections = {config.peers.max_connections}",
             *([f"lock file = {lock_file}"] if lock_file else []),
             f"auth users = {USER}:ro", f"secrets file = {secrets_file}", "strict modes = yes",
             f"timeout = {int(config.peers.timeout)}",
             "refuse options = delete* remove-source-files", ""]
    for name, path in modules(config, node).items():
        lines += [f"[{name}]", f"path = {path}", ""]
    return "\n".join(lines)


def allowed(conf: Peers, addresses: Mapping[str, str]) -> list[str]:
    """Who may connect: ``peers.allow`` where set, else every node's address (``peers.hosts``
    first, then ``addresses``: Slurm's NodeAddr by node name)."""
    if conf.allow:
        return list(conf.allow)
    found = {**addresses, **{n: address(conf, n).rpartition(":")[0] for n in conf.hosts}}
    return sorted(set(found.values()))


def serve_argv(config: Config, node: str, workdir: str, addresses: Mapping[str, str] | None = None) -> list[str]:
    """Write the daemon's configuration and secrets into ``workdir`` (root's alone, reached
    without following a link: fs.safe.RootDir) and return the rsync command that serves them
    in the foreground, bound to this node's address. ``addresses``: node name -> address,
    as Slurm knows them (whom to allow where peers.allow is empty, where to bind)."""
    addresses = dict(addresses or {})
    secret = read_secret(config.peers.secret_file)
    with safe.RootDir(workdir, create=False) as work:
        os.fchmod(work.fd, 0o700)
        safe.write_at(work.fd, "secrets", f"{USER}:{secret}\n", mode=0o600)
        conf = daemon_config(config, node, os.path.join(workdir, "secrets"), allowed(config.peers, addresses),
                             os.path.join(workdir, "rsyncd.lock"))
        safe.write_at(work.fd, "rsyncd.conf", conf, mode=0o600)
    host, _, port = address(config.peers, node).rpartition(":")
    bind = host if node in config.peers.hosts else addresses.get(node, "")
    argv = ["rsync", "--daemon", "--no-detach", f"--config={os.path.join(workdir, 'rsyncd.conf')}", f"--port={port}",
            "--log-file=/dev/stderr"]
    if bind:
        argv.append(f"--address={bind}")  # this node's own address, not every interface
    return argv


def serve(config: Config, node: str, run_dir: str, addresses: Mapping[str, str] | None = None) -> None:
    """Become this node's daemon (exec rsync in the foreground): its configuration and the
    secrets file are written to ``<run_dir>/peers-<node>``, root's alone.

    The run directory and every directory above it must be root's and writable by nobody else
    (or sticky, as /tmp): rsync re-reads its configuration at every connection, so a directory a
    user could rename would let them serve anything as root. Anything else is refused
    (UnsafeStore, naming the path), never followed."""
    with safe.RootDir(run_dir) as run:
        run.dir(f"peers-{node}", mode=0o700)
    argv = serve_argv(config, node, os.path.join(run_dir, f"peers-{node}"), addresses)
    log.info("serving %s to peers on %s", ", ".join(modules(config, node)), address(config.peers, node))
    for h in logging.getLogger().handlers:
        h.flush()
    os.execvp(argv[0], argv)


def address(conf: Peers, node: str) -> str:
    """host:port of ``node``'s daemon."""
    host = conf.hosts.get(node, node)
    return host if ":" in host else f"{host}:{conf.port}"
