"""Print a wheel's runtime requirements (its Requires-Dist, extras left out), minus the
distributions named with --drop: one per line, markers kept, for `pip install -r`.

    python deploy/wheel_requirements.py dist/segserve-*.whl --drop mlx --drop mlx-cpu

Why: the CUDA image installs MLX's CUDA build (`mlx[cuda13]`); segserve's own requirement
`mlx[cpu]` on Linux would add the CPU build's library into the same `mlx/` folder.
Standard library only (it runs in an image's build stage before anything is installed).
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import Parser


def _name(requirement: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else ""


def requirements(wheel: str, drop: set[str]) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(zf.read(meta).decode())
    wanted = {re.sub(r"[-_.]+", "-", d).lower() for d in drop}
    out = []
    for req in headers.get_all("Requires-Dist") or []:
        if re.search(r"\bextra\s*==", req):
            continue
        if _name(req) not in wanted:
            out.append(req.strip())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("wheel")
    p.add_argument("--drop", action="append", default=[], help="a distribution to leave out")
    args = p.parse_args(argv)
    print("\n".join(requirements(args.wheel, set(args.drop))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
