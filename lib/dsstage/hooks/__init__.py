"""What slurmd runs: the warm Prolog (``warm``: datasets already cached, standard library only),
the full Prolog and the Epilog (``job``, deciding with ``decisions``; a sharded dataset's part
with ``shardjob``; what the job is told is dsstage.shards.told), the hook's bound (``bounded``, ``abandoned``), the
``#BB_LUA dataset=`` request records (``bbrequest``), the live views' start and worker (``live``),
``configcache``, ``dryrun`` and the job
log (``joblog``). The job records are ``dsstage.node.jobrecord``. The hook scripts' Python
(``__main__``) runs the warm Prolog first, then ``job`` for what it does not answer.

May import ``dsstage.node``, ``dsstage.slurm`` and everything below; not ``dsstage.cluster``
or the CLI. This ``__init__`` imports nothing: the warm path must stay cheap.
"""
