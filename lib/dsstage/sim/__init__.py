"""The retention simulator's parts: traces, a cache-unaware scheduler, the replay of a
schedule through retention policies, and a lower bound. ``dsstage.simulate`` is the
command."""
