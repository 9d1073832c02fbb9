"""`--plot`: TTFT per request over the run and, when /metrics had it, server memory.

matplotlib is optional (it ships with the `dev` extra); `check_matplotlib` fails before
any load is sent so a long run never ends without its plot.
"""

from __future__ import annotations

import importlib.util

from segserve.server.loadtest.client import LoadTestError
from segserve.server.loadtest.runner import RunResult

_COLORS = {200: "tab:green", 429: "tab:orange", 503: "tab:purple", 507: "tab:red", 0: "gray"}


def check_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise LoadTestError(
            "--plot needs matplotlib, which is not installed in this Python "
            "(pip install matplotlib, or pip install -e '.[dev]')"
        )


def write_plot(path: str, runs: dict[str, RunResult]) -> None:
    """One column per run: TTFT against start time (failures: time to the error) on top,
    server memory in use below when any run sampled it."""
    from matplotlib.figure import Figure  # lazy; Figure needs no pyplot global state

    with_memory = any(r.memory for r in runs.values())
    fig = Figure(figsize=(6 * len(runs), 7 if with_memory else 4), layout="constrained")
    axes = fig.subplots(2 if with_memory else 1, len(runs), sharex="col", sharey="row",
                        squeeze=False)
    for col, (label, result) in enumerate(runs.items()):
        ax = axes[0][col]
        recs = result.records
        for status in sorted({r.status for r in recs}):
            rs = [r for r in recs if r.status == status]
            ys = [r.ttft_s if r.ttft_s is not None else r.e2e_s for r in rs]
            ax.scatter([r.start_s for r in rs], ys, s=12, c=_COLORS.get(status, "tab:blue"),
                       marker="o" if status == 200 else "x", label=f"{status} ({len(rs)})")
        ax.set_title(f"{label} ({result.model})")
        ax.set_ylabel("TTFT (s); failures: time to error")
        if recs:
            ax.legend(title="HTTP status")
        if with_memory:
            mem = axes[1][col]
            if result.memory:
                mem.plot([t for t, _ in result.memory], [b / 1e9 for _, b in result.memory],
                         color="tab:blue")
                mem.set_title(f"server memory ({result.memory_series})", fontsize="small")
            else:
                mem.set_title("server memory: no /metrics series", fontsize="small")
            mem.set_ylabel("GB")
            mem.set_xlabel("time since start (s)")
        else:
            ax.set_xlabel("request start (s)")
    # Rows share their y axis (the runs compare at a glance) and start at 0.
    ys = [r.ttft_s if r.ttft_s is not None else r.e2e_s for res in runs.values()
          for r in res.records]
    axes[0][0].set_ylim(0, max(ys, default=1.0) * 1.05 or 1.0)
    if with_memory:
        top = max((b / 1e9 for res in runs.values() for _, b in res.memory), default=1.0)
        axes[1][0].set_ylim(0, top * 1.05 or 1.0)
    fig.savefig(path, dpi=100)
