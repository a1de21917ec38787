"""The command line: ``main`` parses arguments and maps errors to exit codes in one place; each
verb group is a thin module over the library (``admin``, ``node``, ``cluster``), with what they
share in ``common`` and the JSON output in ``output``; ``fast`` answers ``stage`` and ``verify``
of a ready copy before the parser or the configuration is loaded (dsstage.ready). The top
layer: it may import any package.
"""
