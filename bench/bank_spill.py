"""What a finished turn costs the engine thread when the session bank writes it to the SSD
tier, printed as JSON: `segserve.bank.blocks.to_host` (numpy views of the sealed segment's
buffers, the arrays evaluated at once) against copying every layer's rows (one evaluation
and one fresh numpy array per array, what it did before), interleaved, on a segment shaped
like a turn of a 28-layer model (4 KV heads of 64, float16, a just-sealed turn: views of a
larger tail buffer) and on a copy of it (what a seal makes when the spare is large). Also
the writer thread's side for one block of those rows (`chunk_payload`), which reads the
views either way.

    python bench/bank_spill.py --json-out bench/results/bank_spill_cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import mlx.core as mx
import numpy as np
from common import emit_json

from segserve.bank.blocks import HostRows, chunk_payload, layout_of, to_host
from segserve.kv.segment import Segment


def _copies(seg: Segment, udt: mx.Dtype) -> HostRows:
    """The earlier form: each array's rows copied to a numpy array of its own."""
    return HostRows(tuple(np.array(k.view(udt), copy=True) for k in seg.keys),
                    tuple(np.array(v.view(udt), copy=True) for v in seg.values))


def _segment(layers: int, rows: int, spare: int, heads: int, dim: int, seed: int, sliced: bool) -> Segment:
    shape = (1, heads, rows + spare, dim)
    bufs = [mx.random.normal(shape, key=mx.random.key(seed + i)).astype(mx.float16) for i in range(2 * layers)]
    mx.eval(bufs)
    parts = [b[:, :, :rows, :] for b in bufs]
    if not sliced:
        parts = [mx.array(p) for p in parts]
        mx.eval(parts)
    return Segment.seal(parts[:layers], parts[layers:], list(range(rows)), "root")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rows", default="32,256,1024", help="rows of the turn")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json-out")
    args = p.parse_args()
    results: list[dict[str, Any]] = []
    for rows in (int(r) for r in args.rows.split(",")):
        for sliced in (True, False):
            times: dict[str, list[float]] = {"views_ms": [], "copies_ms": []}
            for rep in range(args.repeats):
                # A fresh segment per call: a sealed turn's arrays are new to both.
                for name, fn in (("views_ms", to_host), ("copies_ms", None)):
                    seg = _segment(args.layers, rows, 24, 4, 64, 1000 * rep, sliced)
                    layout = layout_of(seg)
                    assert layout is not None
                    t = time.perf_counter()
                    if fn is None:
                        _copies(seg, mx.uint16)
                    else:
                        fn(seg, layout)
                    times[name].append((time.perf_counter() - t) * 1e3)
            seg = _segment(args.layers, rows, 24, 4, 64, 7, sliced)
            layout = layout_of(seg)
            assert layout is not None
            host = to_host(seg, layout)
            t = time.perf_counter()
            payload = chunk_payload(host, 0, rows)
            writer_ms = (time.perf_counter() - t) * 1e3
            med = {k: statistics.median(v) for k, v in times.items()}
            row: dict[str, Any] = {"rows": rows, "segment": "tail views" if sliced else "own arrays",
                                   "bytes": len(payload), **{k: round(v, 3) for k, v in med.items()},
                                   "writer_payload_ms": round(writer_ms, 3),
                                   "copies_over_views": round(med["copies_ms"] / med["views_ms"], 2)}
            print(row, flush=True)
            results.append(row)
    emit_json({"layers": args.layers, "repeats": args.repeats, "results": results}, args.json_out)


if __name__ == "__main__":
    main()
