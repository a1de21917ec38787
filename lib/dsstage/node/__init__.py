"""The node store, run as root on a compute node: ``store`` (the tiers, what is ready, leases and
retention applied), ``stage`` (a stage as named steps: authorize, reuse, make room, fill,
publish, lease), ``stager`` (filling a staging area), ``publish``, ``space``, ``lease``,
``lock``, ``access`` (groups and ACLs), ``background`` (purges), ``report`` (this node's
report file), ``inventory`` (the report's body, built from the store) and ``metrics``.

May import ``dsstage.transfer``, ``dsstage.policy``, ``dsstage.config``, ``dsstage.fs`` and the
bottom modules; never Slurm, the hooks or the cluster services: whoever calls the store hands
it the demand and refreshes the report.
"""
