"""Moving bytes and proving them: the ``transport`` protocol a stage fills its staging area
through, chosen once from the source (the verifying copier, ``copier``, its small files
through the native helper: ``native``; its bandwidth limit: ``ratelimit``; or the rsync
transport, ``rsync``), with the peers that share a stage wrapping either (``peers``, with
their daemon in ``peerd``); BLAKE3 hashing (``hashing``) and the check of a tree against its
manifest (``check``), the adaptive limit on requests in flight (``parallel``), and building a
manifest from a source (``build``).

May import ``dsstage.config``, ``dsstage.fs`` and the bottom modules; it knows nothing of the
store's state, leases or Slurm.
"""
