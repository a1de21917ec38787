"""The retention simulator, ``dsstage simulate``: traces (trace.py), a cache-unaware
scheduler (sched.py), the replay of a schedule through retention policies (replay.py), a
lower bound (bound.py), and the command's options and report (cli.py, ``cli.main``)."""
