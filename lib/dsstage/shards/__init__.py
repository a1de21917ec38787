"""Datasets larger than one node, the layer below the store: a dataset's files split into
shards (``split``), a job's shards given to its nodes and the nodes that share one
(``assign``: the job's plan), a version's shard index written (``index``) and read back
(``indexfile``), what a job sees of its part on a node (``views``) and what it is told of it
(``told``: its map and exports, the same from the warm and the full Prolog). Functions over
manifests, names and a tier's descriptors; standard library and dsstage.fs only but for
``split`` and ``index`` (the manifest format), so the warm Prolog may import ``views``,
``told``, ``assign`` and ``indexfile``.

Each layer above keeps one adapter: the store stages a node's part (dsstage.node.sharded) and
records the job's plan from the nodes' reports (dsstage.node.jobrecord.plan), the Prolog
decides for a job's part (dsstage.hooks.shardjob), the cluster shows the maps
(dsstage.cluster.shardmaps). They cannot live here: this package is below the store, which
evicts, lists and verifies views and shards."""
