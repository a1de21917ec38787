"""Services that see the whole cluster: the demand poller (``poller``; one acts at a time:
``leader``), node features for placement (``features``), the bounded wait for data
(``datawait``), prefetch on each node (``prefetch``), pruning old manifests
(``manifests_gc``), reading every node's report (``reports``), ``status`` (drawn by
``status_view``; a sharded job's parts by ``shardmaps``), the controller's metrics
(``controller_metrics``), the answers burst_buffer.lua reads (``bbstat``), and fleet
operations over SSH (``fleet``, ``ssh``, ``fleet_view``).

May import ``dsstage.node``, ``dsstage.slurm`` and everything below; not ``dsstage.hooks`` or
the CLI.
"""
