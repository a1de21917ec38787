"""The Prolog's side of ``start: at-once`` (dsstage.node.live): a job whose dataset did not stage
within ``start_budget`` starts on a live view, and a detached worker finishes the stage.

The worker runs as ``python -I -m dsstage.hooks.job live NODE DATASET DIGEST UID JOB`` in its
own session (it outlives the Prolog, as dsstage.node.background's work does), with the hook's
environment (the configuration's path, the run directory, the job's id), and logs as the hooks
do.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Sequence

from dsstage import proc
from dsstage.config import catalog as cat
from dsstage.config.model import Dataset
from dsstage.errors import DsstageError
from dsstage.fs import runfiles
from dsstage.fs.layout import version_id
from dsstage.hooks.decisions import Verdict
from dsstage.node import live
from dsstage.node.store import Store, local_errors, open_tier

log = logging.getLogger(__name__)


def start(store: Store, ds: Dataset, digest: str, job_id: str, user: cat.User, why: str) -> Verdict:
    """The job's verdict for ``ds``: its live view (made and leased now), a worker started
    unless one is at it or the copy is ready already. Raises DsstageError where the view cannot
    be made (the caller then decides as for any failed stage)."""
    path, work = live.open_for_job(store, ds, digest, job_id, user.name)
    vid = version_id(digest)
    if work:
        try:
            spawn(store.node, ds.name, digest, user.uid, job_id)
        except OSError as exc:  # the view and the lease stand: the job reads the source through it
            log.warning("job %s: %s: the live view's worker did not start (%s); the next job's Prolog starts one",
                        job_id, ds.name, exc)
    log.info("job %s: %s: starting on a live view at %s (%s); its files switch to the verified local copy "
             "as they land", job_id, ds.name, path, why)
    return Verdict(ds.name, "local", path, "live view",
                   exports=(("LIVE", store.layout(ds.tier).root + f"/{live.TOP}/{ds.name}/{live.record_name(vid)}"),))


def spawn(node: str, name: str, digest: str, uid: int, job_id: str) -> None:
    subprocess.Popen([sys.executable, "-I", "-m", "dsstage.hooks.job", "live", node, name, digest, str(uid), job_id],
                     cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, env=proc.c_locale())


def finish(store: Store, name: str, digest: str, user: cat.User) -> str:
    """The worker: stage version ``digest`` of ``name`` under the dataset's lock, switching the
    view's entries as files land, then all of them; what happened, for the log. One worker per
    view: another that holds it already is left to it."""
    from dsstage.node import staging
    ds = store.dataset(name)
    layout = store.layout(ds.tier)
    vid = version_id(digest)
    manifest = store.load_manifest(name, digest)
    paths = [e.path for e in manifest.entries]
    with open_tier(layout) as tier:
        with local_errors(f"finishing the live view of {name!r} in {layout.root}"):
            worker = live.hold_worker(tier, name, vid)
        if worker is None:
            return "another worker finishes it"
        try:
            live.note(tier, name, vid, state=live.FILLING, pid=os.getpid(), reason="")
            with local_errors(f"finishing the live view of {name!r} in {layout.root}"):
                live.revert(tier, name, digest, paths, ds.source.path)  # only what this stage holds stays local

            def progress(local: int, total: int) -> None:
                live.note(tier, name, vid, local=local, files=total)

            switcher = live.Switcher(tier, name, digest, paths, on_round=progress)
            pid = os.getpid()  # the worker holds its lease while it stages (the job's holds the copy)
            holder = f"pid-{os.uname().nodename}-{pid}"
            try:
                result = staging.stage(store, name, staging.StageRequest(user=user, job_id=holder, pid=pid,
                                                                         digest=digest, view=switcher))
                if result.action != "staged":  # ready already (another stage did it): switched here, leased
                    with local_errors(f"finishing the live view of {name!r} in {layout.root}"):
                        live.complete(tier, name, digest, paths)
            except DsstageError as exc:
                live.note(tier, name, vid, state=live.FAILED, local=switcher.total - len(switcher.todo),
                          reason=f"{exc}; the files not yet local are read from the source; the next job's "
                                 "Prolog resumes the stage")
                raise
            finally:
                switcher.stop()
                store.release(name, holder)
            return f"{result.action} in {result.seconds:.1f}s; every file of the view is local"
        finally:
            os.close(worker)


def main(argv: Sequence[str]) -> int:
    """The worker: finish the live view, then refresh the node's report; 0, or 1 if the stage
    failed (the view's record says why; nothing waits on this exit code)."""
    from dsstage.config import load
    from dsstage.node import inventory
    node, name, digest, uid, job_id = argv
    run_dir = os.environ.get("DSSTAGE_RUN_DIR", runfiles.RUN_DIR)
    try:
        store = Store(load.load(run_dir=run_dir), node, run_dir=run_dir)
    except DsstageError as exc:
        log.error("job %s: the live view of %s version %s was not finished: %s", job_id, name, version_id(digest),
                  exc)
        return 1
    try:
        done = finish(store, name, digest, cat.User.lookup(int(uid)))
        log.info("job %s: the live view of %s version %s: %s", job_id, name, version_id(digest), done)
        return 0
    except DsstageError as exc:
        log.error("job %s: the live view of %s version %s was not finished: %s", job_id, name, version_id(digest),
                  exc)
        return 1
    except Exception:  # a bug: logged; the view keeps its links to the source, the next Prolog resumes
        log.exception("job %s: the live view of %s version %s: unexpected failure", job_id, name,
                      version_id(digest))
        return 1
    finally:
        inventory.refresh(store)
