# The packages' dsstage command: this file behind the venv's Python line, in place of pip's
# launcher, which imports re to tidy argv[0] for Windows (about 12 ms of a 38 ms fast
# `dsstage verify`: docs/benchmarks.md).
import sys

from dsstage.cli.main import main

sys.exit(main())
