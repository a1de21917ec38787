"""Moving bytes and proving them: the verifying copier (``copier``, its small files through the
native helper: ``native``; its bandwidth limit: ``ratelimit``), the rsync transport
(``rsync``), BLAKE3 hashing (``hashing``), the adaptive limit on requests in flight
(``parallel``), building a manifest from a source (``build``), and the peers that share a
multi-node stage (``peers``, with their daemon in ``peerd``).

May import ``dsstage.config``, ``dsstage.fs`` and the bottom modules; it knows nothing of the
store's state, leases or Slurm.
"""
