"""`segserve loadtest`: a multi-turn load test for any OpenAI-compatible chat server.

Modules: `workload` (conversations and request bodies, shared with bench/locustfile.py),
`client` (one streamed request, measured), `runner` (closed-loop users, open-loop Poisson
rate, /metrics sampling), `report` (percentiles, table, ratios), `compare` (segmented
against stock), `plot` (matplotlib, optional), `cli` (flags and outputs). No MLX import:
the tool runs anywhere the package's HTTP dependencies do.
"""

from segserve.server.loadtest.cli import build_parser, main
from segserve.server.loadtest.client import LoadTestError

__all__ = ["LoadTestError", "build_parser", "main"]
