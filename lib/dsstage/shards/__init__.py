"""Datasets larger than one node: a dataset's files split into shards (``split``), and a
job's shards given to its nodes (``assign``). Pure functions over manifests and names; the
store, the hooks and the submit check use them."""
