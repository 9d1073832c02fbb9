"""Run Debian's nginx as an unprivileged-friendly test process in front of segserve replicas.

`NginxRouter` renders deploy/nginx/segserve.conf (the shipped file: only the replica list,
the listen address and the njs path are replaced) inside a main configuration whose pid,
logs and temp paths all live in a temporary directory, and runs `nginx -p DIR -c CONF` in
the foreground (`daemon off`). `affinity=False` drops the `hash` line: plain round-robin,
the baseline of the load comparison. `replicas_behind_nginx` starts tiny-model replicas and
one router in front of them, and stops them all however the test ends.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.http_support import free_port
from tests.process_support import ServerProcess, write_tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
NGINX_DIR = REPO / "deploy" / "nginx"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None
)
NJS_MODULE = next(
    (p for p in ("/usr/lib/nginx/modules/ngx_http_js_module.so",
                 "/usr/share/nginx/modules/ngx_http_js_module.so",
                 "/etc/nginx/modules/ngx_http_js_module.so") if os.path.exists(p)),
    None,
)
UPSTREAM_LINE = re.compile(r"^\s*server segserve-\d+:8000 .*;\n", re.M)


def render_site(upstreams: Sequence[str], port: int, njs_dir: Path, *, affinity: bool) -> str:
    """deploy/nginx/segserve.conf with these replicas (host:port), this port, this njs dir."""
    site = (NGINX_DIR / "segserve.conf").read_text()
    first = UPSTREAM_LINE.search(site)
    assert first is not None, "segserve.conf lost its upstream server lines"
    servers = "".join(f"    server {u} max_fails=1 fail_timeout=10s;\n" for u in upstreams)
    site = UPSTREAM_LINE.sub("", site)
    site = site[: first.start()] + servers + site[first.start():]
    site = site.replace('js_path "/etc/nginx/njs/";', f'js_path "{njs_dir}/";')
    site = site.replace("listen 8080;", f"listen 127.0.0.1:{port};")
    if not affinity:
        site = re.sub(r"^\s*hash \$segserve_affinity_key consistent;\n", "", site, flags=re.M)
    return site


class NginxRouter:
    def __init__(self, tmp: Path, upstreams: Sequence[str], *, affinity: bool = True) -> None:
        assert NGINX is not None and NJS_MODULE is not None
        self.dir = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        for sub in ("njs", "client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (tmp / sub).mkdir(exist_ok=True)
        shutil.copy(NGINX_DIR / "segserve_affinity.js", tmp / "njs" / "segserve_affinity.js")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (tmp / "segserve.conf").write_text(
            render_site(upstreams, self.port, tmp / "njs", affinity=affinity))
        user = "user root;\n" if os.geteuid() == 0 else ""  # workers may read the temp dir
        (tmp / "nginx.conf").write_text(
            f"load_module {NJS_MODULE};\n{user}daemon off;\nworker_processes 1;\n"
            f"pid {tmp}/nginx.pid;\nerror_log {tmp}/error.log info;\n"
            "events { worker_connections 256; }\n"
            "http {\n"
            f"  access_log {tmp}/access.log;\n"
            f"  client_body_temp_path {tmp}/client_body;\n  proxy_temp_path {tmp}/proxy;\n"
            f"  fastcgi_temp_path {tmp}/fastcgi;\n  uwsgi_temp_path {tmp}/uwsgi;\n"
            f"  scgi_temp_path {tmp}/scgi;\n"
            f"  include {tmp}/segserve.conf;\n"
            "}\n"
        )
        check = subprocess.run(
            [NGINX, "-t", "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-e", str(tmp / "error.log")],
            capture_output=True, text=True, timeout=30,
        )
        assert check.returncode == 0, check.stderr
        with (tmp / "nginx.out").open("w") as out:
            self.proc = subprocess.Popen(
                [NGINX, "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-e", str(tmp / "error.log")],
                stdout=out, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError("nginx exited:\n" + self.log())
            try:
                httpx.get(self.url + "/health", timeout=2, trust_env=False)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError("nginx did not answer:\n" + self.log()) from None
                time.sleep(0.1)

    def log(self) -> str:
        path = self.dir / "error.log"
        return path.read_text()[-4000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: fast shutdown of master and worker
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@dataclass
class Cluster:
    replicas: list[ServerProcess]
    router: NginxRouter

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.router.url, timeout=120, trust_env=False)

    def addr(self, upstream: str) -> ServerProcess:
        """The replica behind an `X-Segserve-Upstream` address (host:port)."""
        for r in self.replicas:
            if upstream.endswith(f":{r.port}"):
                return r
        raise AssertionError(f"unknown upstream {upstream!r}")


@contextmanager
def replicas_behind_nginx(tmp: Path, n: int = 2) -> Iterator[Cluster]:
    """`n` replicas of a tiny random model, each with its own RAM-only bank (no shared SSD
    tier: a conversation's segments live on one replica), behind one affinity router."""
    model = write_tiny_model_dir(tmp / "model")
    replicas = [
        ServerProcess(tmp / f"replica{i}.log", "--model", str(model), "--bank-dir", "none")
        for i in range(n)
    ]
    router: NginxRouter | None = None
    try:
        for r in replicas:
            r.wait_healthy(180)
        router = NginxRouter(tmp / "nginx", [f"127.0.0.1:{r.port}" for r in replicas])
        yield Cluster(replicas, router)
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.kill()
