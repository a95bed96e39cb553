"""``python -m mlipdd``: the same command as ``mlipdd``."""

import sys

from mlipdd.cli import main

sys.exit(main())
