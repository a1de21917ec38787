"""What a job is told of its part of a sharded dataset on a node, the same whether the warm
path (dsstage.hooks.warm) or the full Prolog (dsstage.hooks.shardjob) answers it: the job's
map of which node holds which shards (a file only the job reads) and the exports beside
``DSSTAGE_PATH_<NAME>``. Standard library only, for the warm path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dsstage.fs import jsontext, runfiles
from dsstage.shards.indexfile import Shard


def write_map(run_dir: str, node: str, job_id: str, reader: tuple[int, int], name: str, version: str,
              shards: Sequence[Shard], plan: Mapping[str, Sequence[str]]) -> str:
    """The job's map (dataset, version, shard count, and each node's shards, files and bytes),
    written for the job's tasks on this node; its path."""
    by_id = {s.id: s for s in shards}
    job_map = {"dataset": name, "version": version[:16], "shard_count": len(shards),
               "nodes": {n: {"shards": sorted(by_id[s].index for s in ids), "files": sum(by_id[s].files for s in ids),
                             "bytes": sum(by_id[s].bytes for s in ids)} for n, ids in sorted(plan.items())}}
    return runfiles.write_job_file(run_dir, node, job_id, f"shards-{name}.json",
                                   jsontext.dumps(job_map, indent=1, sort_keys=True) + "\n", reader)


def exports(mine: Sequence[Shard], count: int, shards: Sequence[Shard], plan: Mapping[str, Sequence[str]],
            files_list: str, files: int, map_path: str) -> tuple[tuple[str, str], ...]:
    """(KEY, value) for ``DSSTAGE_<KEY>_<NAME>``: this node's files list, its shard numbers, the
    shard count, its file count and the least of any node of the job, and the map."""
    by_id = {s.id: s for s in shards}
    least = min(sum(by_id[s].files for s in ids) for ids in plan.values())
    return (("FILES", files_list), ("SHARDS", ",".join(str(s.index) for s in mine)), ("SHARD_COUNT", str(count)),
            ("NODE_FILES", str(files)), ("MIN_FILES", str(least)), ("SHARD_MAP", map_path))
