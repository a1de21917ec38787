"""The ready-copy core: what every path that uses a ready copy shares, and nothing else.

``request`` parses a job's ``--dataset`` value (the name rule the SPANK plugin and
``dsstage_submit.lua`` apply too: tests/unit/test_name_rule.py ties them together);
``lease`` is the store's "find ready, lease, check again, give back" protocol and the one
writer of a lease record; ``lock`` is the dataset lock (an flock of ``locks/<name>.lock``
with its owner record beside it); ``warmconf`` is the configuration the warm paths read,
typed and versioned, written by the full paths from the loaded configuration.

The warm Prolog (dsstage.hooks.warm), the fast ``dsstage stage``/``verify``
(dsstage.cli.fast), the full stage (dsstage.node.staging.reuse, dsstage.node.lock) and the
dry run (dsstage.hooks.dryrun) are adapters over it. Standard library and ``dsstage.fs``
only, and no ``typing`` at run time: the warm paths start a Python for every job
(tests/unit/test_warm_imports.py, the import contracts in pyproject.toml).
"""
