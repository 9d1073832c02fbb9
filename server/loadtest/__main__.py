"""`python -m segserve.server.loadtest ARGS`: the same as `segserve loadtest ARGS`."""

import sys

from segserve.server.loadtest.cli import main

sys.exit(main())
