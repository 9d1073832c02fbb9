"""`python -m server.loadtest ARGS`: the same as `segserve loadtest ARGS`."""

import sys

from server.loadtest.cli import main

sys.exit(main())
