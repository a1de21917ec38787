import sys

from dsstage.cli.main import main

sys.exit(main())
