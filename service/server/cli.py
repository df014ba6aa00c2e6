"""``radixkv serve``: the command line of the cache manager.

``radixkv/cli.py`` adds the sub-command with :func:`add_serve_arguments` and runs it with
:func:`run_serve`; ``python -m radixkv.service.server.cli serve ...`` works on its own too.

The engine is configured by ``--config FILE`` (JSON or TOML, ``EngineConfig.from_file``)
and/or one flag per ``EngineConfig`` field (``--kv-tokens``, ``--page-size``,
``--layer-types``, ...); a flag overrides the file. With neither, the defaults start a small
CPU server. The token comes from ``--token``, ``--token-file`` or ``$RADIXKV_TOKEN`` (the last
two keep it out of ``ps``); it is never logged. An example command: ``docs/service.md``.

KV events: ``--enable-kv-events`` records them; the manager then serves them on its gRPC
stream, and with ``--kv-events-endpoint`` (``--kv-events-replay-endpoint``,
``--kv-events-topic``, ...) also on vLLM's ZMQ wire (``docs/events.md``).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from typing import Any

from radixkv.service.server.auth import DEFAULT_HEALTH_BUDGET
from radixkv.service.server.event_hub import DEFAULT_RING_SIZE
from radixkv.service.server.manager import (
    DEFAULT_EVENTS_INTERVAL_S,
    DEFAULT_HANDSHAKE_TIMEOUT_S,
    DEFAULT_MAX_CONCURRENT_RPCS,
    DEFAULT_QUARANTINE_S,
    ServeOptions,
    serve,
)
from radixkv.service.wire.auth import TOKEN_ENV, resolve_token
from radixkv.service.wire.limits import CallLimits, limits_for
from radixkv.service.wire.transport import DEFAULT_MAX_MESSAGE_BYTES

from radixkv.engine.config import EngineConfig
from radixkv.errors import InvalidArgumentError, RadixKVError
from radixkv.events.zmq_flags import add_arguments as add_kv_event_arguments
from radixkv.events.zmq_flags import config_from_args

DEFAULT_ADDRESS = ServeOptions().address


def _engine_fields() -> list[dataclasses.Field[Any]]:
    return list(dataclasses.fields(EngineConfig))


def _choices() -> dict[str, str]:
    from radixkv.cache.eviction import available_policies
    from radixkv.contracts import STORAGE_ADMIT, WRITE_POLICIES
    from radixkv.engine.config import ADMISSION_POLICIES

    return {"eviction_policy": f": one of {', '.join(available_policies())}",
            "admission_policy": f": one of {', '.join(ADMISSION_POLICIES)}",
            "device": ": cpu, cuda or cuda:N",
            "host_kv_tokens": ": tokens of the host-memory tier behind the device pool (0: off)",
            "host_state_slots": ": Mamba states of the host-memory tier (hybrid models; 0: off)",
            "write_policy": f": one of {', '.join(WRITE_POLICIES)}",
            "storage": ": the storage tier's URL (file:///DIR, ...; needs --host-kv-tokens, and for a hybrid "
                       "model --host-state-slots)",
            "storage_admit": f": one of {', '.join(STORAGE_ADMIT)}",
            "storage_read_threads": ": threads reading one storage batch's slices at once (0: min(4, CPUs))"}


_FIELD_CHOICES = _choices()


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time`` (ISO 8601, UTC), ``level``, ``logger``,
    ``message`` (and ``exception`` when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        import json
        from datetime import datetime, timezone

        doc = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(level: str, fmt: str = "text") -> None:
    """The root logger on stderr at ``level`` (a name, any case), as text or JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), handlers=[handler], force=True)


def _cuda_missing(device: str) -> str | None:
    """Why ``device`` cannot be used here (one line), or None."""
    if not device.startswith("cuda"):
        return None
    import torch

    if not torch.cuda.is_available():
        return (f"--device {device}: CUDA is not available (torch {torch.__version__}, "
                f"{'built without CUDA' if torch.version.cuda is None else 'no CUDA device visible'})")
    return None


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every ``serve`` option to ``parser`` (a sub-parser). Returns it."""
    net = parser.add_argument_group("listening")
    net.add_argument("--address", default=DEFAULT_ADDRESS,
                     help="unix:///DIR/NAME.sock (DIR is made 0700; default %(default)s) or HOST:PORT")
    net.add_argument("--token", default=None, help=f"auth token (prefer --token-file or ${TOKEN_ENV})")
    net.add_argument("--token-file", default=None, help="read the auth token from this file")
    net.add_argument("--allow-readable-token-file", action="store_true",
                     help="accept token files that group or others may read (refused by default)")
    net.add_argument("--operator-token-file", default=None,
                     help="the operator token (Flush, Evict, CheckInvariants need it then; a worker token is refused)")
    net.add_argument("--tls-cert", default=None, help="TCP: server certificate (PEM)")
    net.add_argument("--tls-key", default=None, help="TCP: server private key (PEM)")
    net.add_argument("--tls-ca", default=None, help="TCP: require client certificates signed by this CA")
    net.add_argument("--allow-insecure-tcp", action="store_true",
                     help="allow plaintext TCP on a non-loopback address")
    net.add_argument("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES,
                     help="largest gRPC message accepted or sent (default %(default)s)")
    net.add_argument("--max-concurrent-rpcs", type=int, default=DEFAULT_MAX_CONCURRENT_RPCS,
                     help="calls in flight at once, open streams included (a worker holds two: "
                          "keep-alive and Step); beyond it a call gets RESOURCE_EXHAUSTED at once "
                          "(default %(default)s)")
    net.add_argument("--max-call-items", type=int, default=None,
                     help="entries (queries, items, rids) one call may carry (default max(1024, 4 x rows))")
    net.add_argument("--max-call-tokens", type=int, default=None,
                     help="token ids one call may carry (default max(65536, 4 x kv tokens))")
    net.add_argument("--health-rpcs", type=int, default=DEFAULT_HEALTH_BUDGET,
                     help="unauthenticated health calls in flight at once, apart from --max-concurrent-rpcs "
                          "(default %(default)s)")
    net.add_argument("--handshake-timeout-s", type=float, default=DEFAULT_HANDSHAKE_TIMEOUT_S,
                     help="close a connection that has not completed its handshake by then (default %(default)s)")
    net.add_argument("--no-step-socket", dest="step_socket", action="store_false",
                     help="do not open the Step socket beside a unix: socket (workers then send their step "
                          "calls over the gRPC Step stream)")
    net.add_argument("--reflection", action="store_true", help="enable gRPC server reflection")
    run = parser.add_argument_group("running")
    run.add_argument("--shm-dir", default=None, help="directory of the shared-memory pool files (default /dev/shm)")
    run.add_argument("--grace-s", type=float, default=5.0, help="shutdown drain period (default %(default)s)")
    run.add_argument("--sweep-interval-s", type=float, default=1.0,
                     help="lease sweep period (default %(default)s)")
    run.add_argument("--check-idle", action="store_true", help="run check_invariants() at every idle sweep")
    run.add_argument("--quarantine-s", type=float, default=DEFAULT_QUARANTINE_S,
                     help="hold what an expired session held (not reused: a paused worker may still "
                          "write it) while its worker process still runs, at most this many seconds; "
                          "0 turns quarantine off (default %(default)s: on)")
    run.add_argument("--metrics-port", type=int, default=None,
                     help="serve Prometheus /metrics on this port (0: any free port; default: no endpoint)")
    run.add_argument("--metrics-addr", default="127.0.0.1",
                     help="address of the metrics endpoint (default %(default)s)")
    run.add_argument("--torch-threads", type=int, default=1,
                     help="torch intra-op threads of the manager: its own CPU work is small bookkeeping "
                          "ops, extra threads only contend (default %(default)s)")
    run.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                     help="any case; DEBUG adds radixkv's own decisions (sessions, evictions, leases) "
                          "(default %(default)s)")
    run.add_argument("--log-format", default="text", choices=["text", "json"],
                     help="json: one JSON object per line (time, level, logger, message) for log "
                          "shippers (default %(default)s)")
    add_kv_event_arguments(parser)  # --kv-events-endpoint ... (the ZMQ outlet; off without an endpoint)
    ev = parser.add_argument_group("KV event hub (every event outlet: gRPC streams, TakeEvents, ZMQ)")
    ev.add_argument("--kv-events-ring-size", type=int, default=DEFAULT_RING_SIZE,
                    help="events kept for watchers that resume (start_seq) or lag (default %(default)s)")
    ev.add_argument("--kv-events-interval-s", type=float, default=DEFAULT_EVENTS_INTERVAL_S,
                    help="how often new events go out on ZMQ (default %(default)s)")
    eng = parser.add_argument_group("engine (EngineConfig; a flag overrides --config)")
    eng.add_argument("--config", default=None, help="EngineConfig file (.json or .toml)")
    eng.add_argument("--model-config", default=None, metavar="DIR",
                     help="a Hugging Face model directory (or its config.json): the KV shape (layers, "
                          "KV heads, head_dim, dtype) over --config, under the flags")
    for f in _engine_fields():
        flag = "--" + f.name.replace("_", "-")
        extra = _FIELD_CHOICES.get(f.name, "")
        if f.type in (bool, "bool"):
            eng.add_argument(flag, dest=f"cfg_{f.name}", action=argparse.BooleanOptionalAction, default=None,
                             help=f"EngineConfig.{f.name} (default {f.default})")
        else:
            ftype = f.type if isinstance(f.type, str) else f.type.__name__
            kind = _int_dims if ftype.startswith("tuple[int") else {"int": int, "float": float}.get(ftype, str)
            eng.add_argument(flag, dest=f"cfg_{f.name}", type=kind, default=None, metavar=f.name.upper(),
                             help=f"EngineConfig.{f.name}{extra} (default {f.default!r})")
    return parser


def _int_dims(text: str) -> tuple[int, ...]:
    """``"3,512"`` -> ``(3, 512)`` (a state shape flag)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """``--config`` (or the defaults), then ``--model-config``'s KV shape, then every given
    engine flag applied (validated)."""
    base = EngineConfig.from_file(args.config) if args.config else EngineConfig()
    if getattr(args, "model_config", None):
        from radixkv.engine.model_config import engine_fields_from_model_dir

        base = base.replace(**engine_fields_from_model_dir(args.model_config))
    changes: dict[str, Any] = {}
    for f in _engine_fields():
        v = getattr(args, f"cfg_{f.name}", None)
        if v is not None:
            changes[f.name] = v
    return base.replace(**changes) if changes else base


def serve_options_from_args(args: argparse.Namespace) -> ServeOptions:
    return ServeOptions(
        address=args.address, shm_dir=args.shm_dir, max_message_bytes=args.max_message_bytes,
        grace_s=args.grace_s, sweep_interval_s=args.sweep_interval_s, reflection=args.reflection,
        metrics_port=args.metrics_port, metrics_addr=args.metrics_addr, tls_cert=args.tls_cert,
        tls_key=args.tls_key, tls_ca=args.tls_ca, allow_insecure_tcp=args.allow_insecure_tcp,
        check_idle=args.check_idle, max_concurrent_rpcs=args.max_concurrent_rpcs,
        quarantine_s=args.quarantine_s, kv_events=config_from_args(args),
        events_ring_size=args.kv_events_ring_size, events_interval_s=args.kv_events_interval_s,
        health_rpcs=args.health_rpcs, handshake_timeout_s=args.handshake_timeout_s,
        step_socket=args.step_socket,
        operator_token=resolve_token(token_file=args.operator_token_file,
                                     allow_readable=args.allow_readable_token_file)
        if args.operator_token_file else None)


def call_limits_from_args(args: argparse.Namespace, config: EngineConfig) -> CallLimits | None:
    """``--max-call-items`` / ``--max-call-tokens`` over the pool's defaults (None: neither given)."""
    if args.max_call_items is None and args.max_call_tokens is None:
        return None
    d = limits_for(config.kv_tokens, config.request_rows, config.decode_reserve)
    items = args.max_call_items or d.max_items
    return CallLimits(items, args.max_call_tokens or d.max_tokens, items * max(1, config.decode_reserve))


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT. Returns the exit code (0 after a graceful
    shutdown; 2 when the arguments, the config or the address are unusable)."""
    setup_logging(args.log_level, getattr(args, "log_format", "text"))
    try:
        if args.torch_threads < 1:
            raise InvalidArgumentError(f"--torch-threads must be >= 1, got {args.torch_threads}")
        import torch

        torch.set_num_threads(args.torch_threads)
        config = engine_config_from_args(args)
        missing = _cuda_missing(str(config.device))
        if missing:
            print(f"radixkv serve: {missing}", file=sys.stderr)
            return 2
        token = resolve_token(args.token, args.token_file, allow_readable=args.allow_readable_token_file)
        options = serve_options_from_args(args)
        options = options._replace(call_limits=call_limits_from_args(args, config))
        return asyncio.run(serve(config, token, options))
    except (RadixKVError, OSError) as e:
        print(f"radixkv serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="radixkv", description="radixkv cache manager")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_serve_arguments(sub.add_parser("serve", help="run the cache-manager service"))
    args = parser.parse_args(argv)
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
