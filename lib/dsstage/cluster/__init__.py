"""Services that see the whole cluster: the demand poller (``poller``), node features for
placement (``features``), prefetch on each node (``prefetch``), pruning old manifests
(``manifests_gc``), reading every node's report (``reports``), ``status``, and fleet operations
over SSH (``fleet``, ``ssh``, ``fleet_view``).

May import ``dsstage.node``, ``dsstage.slurm`` and everything below; not ``dsstage.hooks`` or
the CLI.
"""
