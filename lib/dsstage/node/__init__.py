"""The node store, run as root on a compute node: ``store`` (the tiers, what is ready, leases and
retention applied), ``staging`` (a stage as named steps: authorize, reuse, make room, fill,
publish, lease), ``stager`` (filling a staging area through a dsstage.transfer.transport),
``publish``, ``space``, ``lease``,
``lock`` (waiting for the dataset lock of dsstage.ready), ``access`` (groups and ACLs),
``background`` (purges), ``eviction``, ``verifying`` and ``treecheck``, ``local``, ``report`` (this node's report file),
``inventory`` (the report's body, built from the store), ``metrics``, ``rollout``; a sharded
dataset's part staged (``sharded``; the rest of sharding is dsstage.shards), a stage no job's
Prolog asks for (``standalone``: ``dsstage stage``, ``warm``, a prefetch); the job records
(``jobrecord``: versions, hold claims, shard plans); a job's live view of a dataset still
staging (``live``); the shared state directory's layout (``statedir``); and the cluster's
share of a source: ``breaker``, ``budget``, ``stagers``.

May import ``dsstage.transfer``, ``dsstage.policy``, ``dsstage.config``, ``dsstage.ready``, ``dsstage.fs`` and the
bottom modules; never Slurm, the hooks or the cluster services: whoever calls the store hands
it the demand and refreshes the report.
"""
