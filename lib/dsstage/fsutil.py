"""Small file helpers shared by the store, leases, locks and manifests.

They live in nodefs.py, which must import nothing but the standard library's lightest
modules; this module is where the rest of dsstage imports them from.
"""

from .nodefs import read_json, write_atomic, write_json

__all__ = ["read_json", "write_atomic", "write_json"]
