"""What slurmd runs: the warm Prolog (``warm``: datasets already cached, standard library only),
the full Prolog and the Epilog (``job``), the ``#BB_LUA dataset=`` request records
(``bbrequest``) and the job log (``joblog``). ``python -m dsstage.hooks prolog|epilog`` runs
``job``; the Prolog script runs ``python -m dsstage.hooks.warm prolog`` first.

May import ``dsstage.node``, ``dsstage.slurm`` and everything below; not ``dsstage.cluster``
or the CLI. This ``__init__`` imports nothing: the warm path must stay cheap.
"""
