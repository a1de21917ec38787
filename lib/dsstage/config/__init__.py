"""What the admins and data owners declare: the configuration's model (``model``), its loading and
validation (``load``, ``sections``), the names it may hold (``names``), a dataset's source
(``source``), the dataset catalog and who may use each dataset (``catalog``), and the
manifest format with its digest (``manifest``).

May import ``dsstage.fs`` and the bottom modules (errors, units, proc, ui, hostlist); nothing
that stages, decides or talks to Slurm.
"""
