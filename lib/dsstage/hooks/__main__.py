"""``python -I -m dsstage.hooks prolog|epilog``: what the Prolog and Epilog scripts run.

The Prolog first tries the warm path (``dsstage.hooks.warm``: standard library only); only a
job it does not answer loads the full Prolog (``dsstage.hooks.job``), which decides and explains.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from dsstage.hooks import warm


def main(argv: Sequence[str]) -> int:
    if list(argv) == ["prolog"]:
        rc = warm.main(argv)
        if rc is not None:
            return rc
    from dsstage.hooks import job
    return job.main(list(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
