"""Datasets larger than one node: a dataset's files split into shards (``split``), a job's
shards given to its nodes (``assign``), and a version's shard index written (``index``) and
read back (``indexfile``). Pure functions over manifests and names; the
store, the hooks and the submit check use them."""
