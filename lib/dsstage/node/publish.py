"""The publish protocol: how a verified staging area becomes a ready, shared copy.

1. ``staging/<name>.<version>/`` (0700, root) is filled and every file verified;
2. it is sealed: root-owned, files 0444, directories 0555, nothing the manifest does not
   list (seal, the last step of dsstage.node.stager.fill);
3. it is renamed to ``datasets/<name>/<version>`` (atomic; jobs never see a partial copy);
4. the ready mark ``ready/<name>/<version>.json`` is written last, naming the digest and
   the inode of the copy (and the bytes it hard-links from older versions, see space.py).

A copy is ready only while its mark exists and matches (layout.not_ready). Taking a copy
out of service removes or flags the mark first. All of it runs on descriptors
(safe.RootDir, Tree): nothing a user could plant is followed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Collection, Mapping
from typing import Any

from dsstage.fs import layout, safe
from dsstage.fs.beneath import Tree
from dsstage.fs.safe import RootDir


def seal(root_fd: int, gid: int = 0, wanted: Collection[str] | None = None,
         made: Collection[str] = frozenset()) -> int:
    """Make the tree below ``root_fd`` root-owned and read-only: files 0444, directories
    0555 (changing only what is not so already), and remove what is neither a regular file
    nor a directory. With ``wanted`` (a manifest's paths), also remove whatever it does not
    list, in the same walk (a staging area is walked once: stager.fill). ``made``: files
    known to be sealed as they were made (TransferStats.sealed: the verifying copier's own),
    which are not looked at again where their directory hands its files no other group
    than ``gid``; the rest of the tree is read from its directories' listings, and each
    other file is checked. The count of entries removed."""
    uid, gid = safe.owner(gid)

    def fix(fd: int, st: os.stat_result, want: int) -> None:
        if st.st_uid != uid or st.st_gid != gid:
            os.fchown(fd, uid, gid)
        if stat.S_IMODE(st.st_mode) != want:
            os.fchmod(fd, want)

    dirs = None if wanted is None else dirs_of(wanted)
    removed = 0
    with Tree(root_fd) as tree:
        for dfd, found in tree.listing(descend=(lambda _rel: True) if dirs is None else dirs.__contains__):
            dst = os.fstat(dfd)
            # a set-group-ID directory gives its files its own group: then none is taken as made sealed
            trusted = made if dst.st_gid == gid and not dst.st_mode & stat.S_ISGID else frozenset()
            for name, rel, kind in found:
                if kind == stat.S_IFDIR:
                    if dirs is not None and rel not in dirs:
                        safe.remove_at(dfd, name)
                        removed += 1
                elif kind != stat.S_IFREG or (wanted is not None and rel not in wanted):
                    safe.unlink_at(dfd, name)  # never published: only the manifest's regular files are data
                    removed += 1
                elif rel not in trusted:
                    st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                    if st.st_uid != uid or st.st_gid != gid or stat.S_IMODE(st.st_mode) != 0o444:
                        ffd = os.open(name, safe.O_READ, dir_fd=dfd)
                        try:
                            fix(ffd, os.fstat(ffd), 0o444)
                        finally:
                            os.close(ffd)
            fix(dfd, dst, safe.sealed_dir_mode())
    return removed


def dirs_of(paths: Collection[str]) -> set[str]:
    """Every directory the relative ``paths`` lie in, and those above them."""
    dirs = {p.rsplit("/", 1)[0] for p in paths if "/" in p}
    for d in list(dirs):
        while "/" in d:
            d = d.rsplit("/", 1)[0]
            if d in dirs:
                break
            dirs.add(d)
    return dirs


def take_back(tier: RootDir, name: str, digest: str) -> None:
    """A copy without a valid mark (a crash between publish and mark, a copy flagged bad,
    tampering): move it back into staging, where every file is verified again before it is
    published (or drop it if a staging area exists already)."""
    vid = layout.version_id(digest)
    dfd = tier.dir("datasets", name)
    try:
        os.stat(vid, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    unmark(tier, name, digest)
    staging = layout.staging_name(name, digest)
    sfd = tier.dir("staging")
    tier.forget("datasets", name, vid)
    try:
        os.stat(staging, dir_fd=sfd, follow_symlinks=False)
        safe.remove_at(dfd, vid)
    except FileNotFoundError:
        # root writes into the read-only directories: no chmod that would lock out readers
        os.rename(vid, staging, src_dir_fd=dfd, dst_dir_fd=sfd)


def publish(tier: RootDir, name: str, digest: str, record: Mapping[str, Any]) -> None:
    """Rename the staging area into place and write its ready mark. The staging area is as
    stager.fill leaves it: exactly the manifest, verified and sealed."""
    staging = layout.staging_name(name, digest)
    vid = layout.version_id(digest)
    tier.forget("staging", staging)
    dfd = tier.dir("datasets", name)
    os.rename(staging, vid, src_dir_fd=tier.dir("staging"), dst_dir_fd=dfd)
    # what rsync kept of files cut short is of no use once the copy is whole
    safe.remove_at(tier.dir("staging"), layout.partial_dir(staging))
    try:
        st = os.stat(vid, dir_fd=dfd, follow_symlinks=False)
        mark = {**record, "digest": digest, "ino": st.st_ino, "dev": st.st_dev, "boot": layout.boot_id(),
                "durable": False}
        safe.write_json_at(tier.dir("ready", name), layout.mark_name(digest), mark)
        os.fsync(dfd)
    except BaseException:
        # no mark (a full filesystem, a signal): the copy goes back to its staging area, which
        # its reservation counts and the next stage resumes, rather than stay unseen in datasets/
        try:
            take_back(tier, name, digest)
        except OSError:
            pass  # the next stage of this version takes it back before anything else
        raise


def unmark(tier: RootDir, name: str, digest: str) -> dict[str, Any]:
    """Take the copy out of service: remove its ready mark; return what the mark held."""
    mark = layout.read_mark(tier, name, digest)
    safe.unlink_at(tier.has_dir("ready", name), layout.mark_name(digest))
    return mark


def flag_bad(tier: RootDir, name: str, digest: str, why: str) -> None:
    """A copy known to be wrong is never ready: keep its mark (its bytes still count) but
    flag it, so that the quick check refuses it and the next stage takes it back."""
    mark = layout.read_mark(tier, name, digest)
    if mark:
        mark["bad"] = why
        safe.write_json_at(tier.dir("ready", name), layout.mark_name(digest), mark)
