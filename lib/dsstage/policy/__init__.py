"""Pure decisions: the retention planner (``retention``: keep or evict each copy, with its reason),
the queue's demand as the planner reads it (``demand``: the snapshot the poller writes), the
bounded wait for data (``datawait``: which pending jobs wait for which nodes), and the
simulator that replays job traces through the planner and its rivals (``sim``).

May import ``dsstage.config``, ``dsstage.fs`` and the bottom modules; never the store, the
transfers or Slurm: the planner runs the same in the Epilog, ``dsstage evict`` and the simulator.
"""
