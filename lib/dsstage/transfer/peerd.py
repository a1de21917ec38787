"""The peer daemon (``dsstage peers serve``): an rsync daemon per node serving the tiers'
``staging`` and ``datasets`` read-only to the other nodes' root, authenticated with the shared
secret; its configuration, private working directory and start.
"""

from __future__ import annotations

import logging
import os
import stat

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


def daemon_config(config: Config, node: str, secrets_file: str) -> str:
    """rsyncd.conf for ``node``: read-only, authenticated, only the tiers' data (pure)."""
    lines = [f"# dsstage peers serve: node {node}, from {config.origin}",
             "use chroot = yes", "read only = yes", "write only = no", "list = no",
             # the staging areas are root's only (0700); nothing is written
             "uid = root", "gid = root", "reverse lookup = no",
             f"auth users = {USER}:ro", f"secrets file = {secrets_file}", "strict modes = yes",
             f"timeout = {int(config.peers.timeout)}",
             "refuse options = delete* remove-source-files", ""]
    for name, path in modules(config, node).items():
        lines += [f"[{name}]", f"path = {path}", ""]
    return "\n".join(lines)


def serve_argv(config: Config, node: str, workdir: str) -> list[str]:
    """Write the daemon's configuration and secrets into ``workdir`` (root's, private) and
    return the rsync command that serves them in the foreground."""
    secret = read_secret(config.peers.secret_file)
    secrets = os.path.join(workdir, "secrets")
    conf = os.path.join(workdir, "rsyncd.conf")
    _write_private(secrets, f"{USER}:{secret}\n")
    _write_private(conf, daemon_config(config, node, secrets))
    host, _, port = address(config.peers, node).rpartition(":")
    argv = ["rsync", "--daemon", "--no-detach", f"--config={conf}", f"--port={port}", "--log-file=/dev/stderr"]
    if node in config.peers.hosts:
        argv.append(f"--address={host}")  # the address the site gave for this node
    return argv


def _write_private(path: str, text: str) -> None:
    """Write ``path`` (in a directory only root can write) as root's alone, replacing it whole."""
    tmp = os.path.join(os.path.dirname(path), safe.temp_name())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        safe.write_all(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def private_dir(path: str) -> str:
    """``path``, a directory only root can enter, created if missing; refused if it is
    anything else (a link, another owner, open to others)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(f"{path}: must be a directory of root's that nobody else can enter; remove it and "
                          "start again")
    return path


def serve(config: Config, node: str, run_dir: str) -> None:
    """Become this node's daemon (exec rsync in the foreground): its configuration and the
    secrets file are written to ``<run_dir>/peers-<node>``, root's alone."""
    os.makedirs(run_dir, mode=0o755, exist_ok=True)
    workdir = private_dir(os.path.join(run_dir, f"peers-{node}"))
    argv = serve_argv(config, node, workdir)
    log.info("serving %s to peers on %s", ", ".join(modules(config, node)), address(config.peers, node))
    for h in logging.getLogger().handlers:
        h.flush()
    os.execvp(argv[0], argv)


def address(conf: Peers, node: str) -> str:
    """host:port of ``node``'s daemon."""
    host = conf.hosts.get(node, node)
    return host if ":" in host else f"{host}:{conf.port}"
