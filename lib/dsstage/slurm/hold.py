"""What a hold says: the reason Slurm shows, and the message dsstage appends to the job's
AdminComment (never the user's Comment), without anything job_submit.lua could take for its tag.
"""

from __future__ import annotations

import logging
import re
import unicodedata

from dsstage.slurm.records import Job

log = logging.getLogger(__name__)

#: the longest hold reason dsstage writes into a job (it is one line on a terminal)
MAX_REASON = 400
#: what ``hold`` did; the text the Prolog logs
HELD = "requeued and held"
ALREADY_HELD = "already requeued and held, or ending: left as it is"
CANCELLED = "interactive allocation: not requeued (only batch jobs can be); cancelled, the reason sent to salloc/srun"
NOT_REQUEUED = ("batch job submitted with --no-requeue: not requeued; its TaskProlog fails it, "
                "the reason in the job's output")
GONE = "the job is gone: nothing to hold"
#: dsstage's own part of an AdminComment: from these words to the end
_OWN_PART = re.compile(r"(?:^|\s+)dsstage (?:held|cancelled|stopped) this job: .*\Z", re.S)
#: the same, for the modules that write other parts of the comment before it
OWN_PART = _OWN_PART
#: a word that job_submit.lua's tag parser (TAG_RE) would take for the tag, or the demand
#: poller for its wait marker (dsstage.policy.datawait)
_TAG_LOOKALIKE = re.compile(r"(?<!\S)dsstage(-wait(?:ed)?)?=")


def clean_reason(text: str, limit: int = MAX_REASON) -> str:
    """``text`` as one line of at most ``limit`` characters that Slurm and a terminal can take.

    Whitespace runs become one space; control, format and unassigned characters (escape
    sequences, bidi overrides) are dropped; a word that looks like the ``dsstage=`` tag is
    defused. The Prolog's reason quotes paths and error messages, which nobody vetted.
    """
    kept = "".join(" " if c.isspace() else c for c in text
                   if c.isspace() or unicodedata.category(c)[0] != "C")
    line = _TAG_LOOKALIKE.sub(lambda m: m.group(0)[:-1] + ":", " ".join(kept.split()))
    if len(line) > limit:
        line = line[:max(limit - 3, 0)].rstrip() + "..."
    return line


def hold_message(job: Job, reason: str) -> str:
    """What the user reads in AdminComment (and, for an allocation, on the terminal)."""
    if not job.batch:
        return f"dsstage cancelled this job: {reason} (an interactive allocation cannot be requeued)"
    if not job.requeue:
        return f"dsstage stopped this job: {reason} (it was submitted with --no-requeue)"
    return f"dsstage held this job: {reason} -- once that is fixed: scontrol release {job.job_id}"


def merge_admin_comment(current: str, message: str) -> str:
    """``current`` with dsstage's earlier message, if any, replaced by ``message``.

    Everything before dsstage's part is kept as it is: the ``dsstage=`` tag and whatever the
    site keeps there. dsstage's part runs to the end (dsstage always appends it last).
    """
    kept = _OWN_PART.sub("", current or "").rstrip()
    return f"{kept} {message}" if kept else message
