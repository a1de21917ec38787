"""dsstage's face to Slurm: the client (``client``: squeue, sinfo, scontrol through one interface,
with a pyslurm backend where it imports, and ``fake`` for tests), the records parsed from its
output (``records``), what a hold says (``hold``), checks of slurm.conf (``conf``, read as slurmd
reads it by ``conffile``), the SPANK plugin's build checked (``spank``) and the catalog
job_submit.lua reads (``luacatalog``).

May import ``dsstage.transfer`` (the peers' secret, for ``conf``), ``dsstage.config``,
``dsstage.fs`` and the bottom modules; never the store.
"""
