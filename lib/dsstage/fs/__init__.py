"""The node filesystem protocol: how root reaches anything a user could have planted.

``safe`` opens a store root from ``/`` one component at a time and does every create, rename,
unlink and chmod relative to directory descriptors (``RootDir``); ``beneath`` opens paths below
a descriptor without following links (openat2, ``Tree``); ``layout`` is the store's shape on a
tier (names, ready marks, what makes a copy ready); ``runfiles`` the TaskProlog's file and the
configuration cache in the run directory; ``identity`` switches the file-system identity to
read a source as its owner; ``untrusted`` reads what data owners and other nodes write
(manifests, ``CURRENT``, reports, records) without blocking, following links or reading
without bound; ``shared`` checks the records in the shared state directory that root acts on; ``acl``
writes POSIX ACLs on a descriptor; ``pathtext`` escapes a path into one line (manifests, a
view's files list); ``groups`` looks up a user's groups; ``jsontext`` reads and writes JSON
text; ``formats`` versions every record dsstage writes. The warm Prolog uses this package, so it imports only the
standard library and ``dsstage.errors``: nothing else of dsstage.
"""
