"""`python -m ember.daemon.cli_main` runs the `ember` command without the console script."""

import sys

from .cli import main

sys.exit(main())
