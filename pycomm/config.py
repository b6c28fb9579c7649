"""Every PYCOMM_* environment knob, read in one place.

The variables (ENV_VARS below), their defaults and what they do are documented in
one place, docs/configuration.md; tests/test_docs.py checks that it lists exactly
ENV_VARS.

This module is the only reader of PYCOMM_* (setup.py reads PYCOMM_BUILD_CUDA at
build time, pycomm_autoload PYCOMM_AUTOLOAD at import torch): `group_config` turns a `Config` plus what torch passes into the C++
core's one options object, `pycomm._C.GroupConfig` (csrc/common/group_config.h).
"""
from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import math
import os
import socket
import stat
import struct
from collections.abc import Mapping

from . import _C
from .streams import MAX_IO_THREADS, MAX_STREAMS, choose_streams, link_gbps

__all__ = ["Config", "load_config", "bind_address", "group_config", "ENV_VARS", "ALGORITHMS", "TRANSPORTS",
           "COST_FIELDS", "cost_cache_path", "read_cost_model", "resolve_streams"]

ENV_VARS = ("PYCOMM_ALGO", "PYCOMM_TRANSPORT", "PYCOMM_SEGMENT_BYTES", "PYCOMM_SOCKET_IFNAME", "PYCOMM_CHECK",
            "PYCOMM_SHM_SPREAD", "PYCOMM_DEBUG", "PYCOMM_SECRET", "PYCOMM_SECRET_FILE", "PYCOMM_COST_MODEL",
            "PYCOMM_SOCKETS_PER_PEER", "PYCOMM_IO_THREADS", "PYCOMM_WIRE")
# "auto" and the all-reduce table's names, from the C++ core (allreduce_registry.h).
ALGORITHMS = tuple(_C.allreduce_algorithms())
# The shortest job secret accepted (csrc/transport/wire.h kMinSecretBytes says the same).
MIN_SECRET_BYTES = 16
TRANSPORTS = ("auto", "shm", "tcp")
WIRE_MODES = ("auto", "integrity", "none")
# The constants of the cost model (csrc/common/cost_model.h), as named in Python.
COST_FIELDS = ("alpha", "beta", "gamma", "delta", "shm_alpha", "shm_beta", "cpu_beta", "cpu_beta_oneway",
               "link_burst")
# Fields a calibration made before they existed may lack, and what they then are
# (cpu_beta 0: the link's beta stood for the TCP copies too; cpu_beta_oneway 0: half of
# cpu_beta; link_burst 0: no token bucket on the link).
_COST_FIELD_DEFAULTS = {"cpu_beta": 0.0, "cpu_beta_oneway": 0.0, "link_burst": 0.0}


@dataclasses.dataclass(frozen=True)
class Config:
    """A process group's PYCOMM_* settings (docs/configuration.md), as `load_config`
    read them from the environment."""

    algorithm: str = "auto"
    segment_bytes: int = 256 * 1024
    socket_ifname: str | None = None
    check_calls: bool = False
    transport: str = "auto"
    shm_spread: bool = True
    debug: bool = False
    # The job secret (PYCOMM_SECRET / PYCOMM_SECRET_FILE); "" when unset. Kept out of repr().
    secret: str = dataclasses.field(default="", repr=False)
    # The cost model's constants ({field: seconds} over COST_FIELDS), or None for the
    # built-in ones (PYCOMM_COST_MODEL).
    cost_model: dict | None = None
    # TCP streams per peer and I/O threads: "auto" or a count (PYCOMM_SOCKETS_PER_PEER,
    # PYCOMM_IO_THREADS), and one stream's throughput on this host in Gbit/s (the
    # calibration's, None when not measured) that auto chooses with.
    sockets_per_peer: int | str = "auto"
    io_threads: int | str = "auto"
    per_stream_gbps: float | None = None
    # PYCOMM_WIRE, resolved: "integrity" or "none".
    wire: str = "none"


def _flag(env, name: str, default: str) -> bool:
    return env.get(name, default).strip() not in ("", "0")


def load_config(environ=None) -> Config:
    """The PYCOMM_* settings in `environ` (default: os.environ) as a Config; ValueError
    naming the variable when a value is invalid."""
    env = os.environ if environ is None else environ
    algorithm = env.get("PYCOMM_ALGO", "auto").strip().lower() or "auto"
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"pycomm: PYCOMM_ALGO={algorithm!r} is not one of {', '.join(ALGORITHMS)}"
        )
    raw_segment = env.get("PYCOMM_SEGMENT_BYTES", "262144")
    try:
        segment = int(raw_segment)
    except ValueError:
        raise ValueError(f"pycomm: PYCOMM_SEGMENT_BYTES={raw_segment!r} is not an integer") from None
    if segment < 64:
        raise ValueError(f"pycomm: PYCOMM_SEGMENT_BYTES={segment} is too small (minimum 64)")
    transport = env.get("PYCOMM_TRANSPORT", "auto").strip().lower() or "auto"
    if transport not in TRANSPORTS:
        raise ValueError(
            f"pycomm: PYCOMM_TRANSPORT={transport!r} is not one of {', '.join(TRANSPORTS)}"
        )
    ifname = env.get("PYCOMM_SOCKET_IFNAME") or None
    check = _flag(env, "PYCOMM_CHECK", "0") or (
        env.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL"
    )
    # Spreading is on unless exactly "0"; debug is on unless unset, empty or "0".
    spread = env.get("PYCOMM_SHM_SPREAD", "1").strip() != "0"
    secret = _secret(env)
    return Config(algorithm=algorithm, segment_bytes=segment, socket_ifname=ifname, check_calls=check,
                  transport=transport, shm_spread=spread, debug=_flag(env, "PYCOMM_DEBUG", "0"),
                  secret=secret, cost_model=_cost_model(env),
                  sockets_per_peer=_count(env, "PYCOMM_SOCKETS_PER_PEER", MAX_STREAMS),
                  io_threads=_count(env, "PYCOMM_IO_THREADS", MAX_IO_THREADS), per_stream_gbps=_per_stream(env),
                  wire=_wire(env, secret))


def _wire(env, secret: str) -> str:
    wire = env.get("PYCOMM_WIRE", "auto").strip().lower() or "auto"
    if wire not in WIRE_MODES:
        raise ValueError(f"pycomm: PYCOMM_WIRE must be one of {', '.join(WIRE_MODES)} (got {wire!r})")
    if wire == "auto":
        return "integrity" if secret else "none"
    return wire


def with_settings(settings=None):
    """The environment a group reads its PYCOMM_* knobs from: this process's, with
    ``settings`` (PYCOMM_* name -> value) over it; os.environ itself when there are none.
    ``settings`` reach a pycomm group as ``pg_options``, e.g.
    ``dist.init_process_group("pycomm", pg_options={"PYCOMM_TRANSPORT": "tcp"})``."""
    if not settings:
        return os.environ
    if not isinstance(settings, Mapping):
        raise TypeError(f"pycomm: settings (pg_options) must map PYCOMM_* names to values "
                        f"(got {type(settings).__name__})")
    bad = [name for name in settings if not (isinstance(name, str) and name.startswith("PYCOMM_"))]
    if bad:
        raise ValueError(f"pycomm: settings are PYCOMM_* knobs (got {', '.join(map(repr, bad))})")
    env = dict(os.environ)
    env.update({name: str(value) for name, value in settings.items()})
    return env


def _count(env, name: str, most: int) -> int | str:
    raw = env.get(name, "auto").strip().lower() or "auto"
    if raw == "auto":
        return raw
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"pycomm: {name}={raw!r} is not auto or an integer") from None
    if not 1 <= value <= most:
        raise ValueError(f"pycomm: {name}={value} is out of range (1..{most}, or auto)")
    return value


def _per_stream(env) -> float | None:
    """One TCP stream's throughput (Gbit/s) from the calibration PYCOMM_COST_MODEL
    names, else (unset) this host's cache; None when not measured, or with
    PYCOMM_COST_MODEL=default (the built-in constants: nothing measured, whatever the
    cache holds)."""
    knob = env.get("PYCOMM_COST_MODEL", "").strip()
    if knob == "default":
        return None
    path = knob if knob else cost_cache_path(env)
    try:
        with open(path) as handle:
            value = float(json.load(handle)["streams"]["per_stream_gbps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if value > 0 else None


def resolve_streams(config: Config, bind_address: str, cpus: int | None = None) -> tuple:
    """(sockets per peer, I/O threads) for a group listening on `bind_address`:
    the knobs where set, else pycomm.streams.choose_streams."""
    streams, threads = choose_streams(link_gbps(bind_address), config.per_stream_gbps, cpus)
    if config.sockets_per_peer != "auto":
        streams = int(config.sockets_per_peer)
        threads = choose_streams(1.0, 1.0 / streams, cpus)[1] if streams > 1 else 1
    if config.io_threads != "auto":
        threads = int(config.io_threads)
    return streams, threads


def cost_cache_path(environ=None) -> str:
    """Where this host's calibration is cached: $XDG_CACHE_HOME (or ~/.cache)
    /pycomm/cost_model-<hostname>.json."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pycomm", f"cost_model-{socket.gethostname()}.json")


def read_cost_model(path: str) -> dict:
    """The constants of a calibration file ({field: seconds} over COST_FIELDS);
    ValueError naming the file when it is not one."""
    try:
        with open(path) as handle:
            data = json.load(handle)
        model = {name: float(data["model"][name] if name in data["model"] or name not in _COST_FIELD_DEFAULTS
                             else _COST_FIELD_DEFAULTS[name]) for name in COST_FIELDS}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"pycomm: {path} is not a pycomm cost-model calibration ({exc}); "
                         "make one with python -m pycomm.plan --calibrate") from None
    # seconds, in [0, 1); link_burst is bytes, any finite count
    bad = [name for name, value in model.items()
           if not 0.0 <= value < (math.inf if name == "link_burst" else 1.0)]
    if bad:
        raise ValueError(f"pycomm: {path}: {', '.join(bad)} out of range (seconds in [0, 1); "
                         "link_burst: bytes, >= 0)")
    return model


def _cost_model(env) -> dict | None:
    knob = env.get("PYCOMM_COST_MODEL", "").strip()
    if knob == "default":
        return None
    if knob:
        return read_cost_model(knob)
    cached = cost_cache_path(env)
    if not os.path.exists(cached):
        return None
    try:
        return read_cost_model(cached)
    except ValueError:
        return None  # a damaged cache is ignored (PYCOMM_COST_MODEL=path reports it)


def _secret(env) -> str:
    """The job secret from PYCOMM_SECRET or PYCOMM_SECRET_FILE ("" if neither is
    set). Messages never show the secret itself."""
    text = env.get("PYCOMM_SECRET")
    path = env.get("PYCOMM_SECRET_FILE")
    if text is not None and path is not None:
        raise ValueError("pycomm: set PYCOMM_SECRET or PYCOMM_SECRET_FILE, not both")
    if path is not None:
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise ValueError(f"pycomm: PYCOMM_SECRET_FILE={path!r} cannot be read "
                             f"({type(exc).__name__}: {exc.strerror})") from None
        if mode & 0o077:
            # As ssh refuses a private key others can read: a secret they can read is no secret.
            raise ValueError(f"pycomm: PYCOMM_SECRET_FILE={path!r} is readable or writable by group or others "
                             f"(mode {stat.S_IMODE(mode):04o}); chmod 600 it")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"pycomm: PYCOMM_SECRET_FILE={path!r} cannot be read "
                             f"({type(exc).__name__}: {getattr(exc, 'strerror', None) or 'not UTF-8 text'})") from None
        text = text.strip()
        if not text:
            raise ValueError(f"pycomm: PYCOMM_SECRET_FILE={path!r} holds no secret (the file is empty)")
    elif text is not None:
        if not text:
            raise ValueError("pycomm: PYCOMM_SECRET is set but empty")
    if text and len(text.encode("utf-8")) < MIN_SECRET_BYTES:
        knob = "PYCOMM_SECRET_FILE's secret" if path is not None else "PYCOMM_SECRET"
        raise ValueError(f"pycomm: {knob} is {len(text.encode('utf-8'))} bytes; at least {MIN_SECRET_BYTES} are "
                         "required (e.g. python -c 'import secrets; print(secrets.token_hex(16))')")
    return text or ""


def group_config(config: Config, *, timeout: datetime.timedelta, bind_address: str, global_ranks,
                 store_prefix: str) -> "_C.GroupConfig":
    """The C++ options object of one process group: `config` plus what torch passes."""
    options = _C.GroupConfig()
    options.timeout = timeout
    options.bind_address = bind_address
    options.segment_bytes = config.segment_bytes
    options.algorithm = config.algorithm
    options.global_ranks = [int(r) for r in global_ranks]
    options.check_calls = config.check_calls
    options.store_prefix = store_prefix
    options.transport = config.transport
    options.shm_spread = config.shm_spread
    options.debug = config.debug
    options.secret = config.secret
    options.wire = config.wire
    options.sockets_per_peer, options.io_threads = resolve_streams(config, bind_address)
    if config.cost_model is not None:
        for name, value in config.cost_model.items():
            setattr(options.cost, name, value)
    return options


def _interface_address(ifname: str) -> str:
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", ifname.encode()[:15]))
        except OSError as exc:
            raise ValueError(
                f"pycomm: PYCOMM_SOCKET_IFNAME={ifname!r}: no IPv4 address on that interface ({exc})"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def _route_to(host: str) -> str | None:
    """The local address the kernel would use to reach `host`."""
    try:
        target = socket.gethostbyname(host)
    except OSError:
        return None
    if target.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((target, 9))  # UDP connect sends nothing
            return sock.getsockname()[0]
        except OSError:
            return None


def _store_host(store) -> str | None:
    seen = 0
    while store is not None and seen < 16:
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        seen += 1
    return None


def bind_address(config: Config, store=None) -> str:
    if config.socket_ifname:
        return _interface_address(config.socket_ifname)
    for host in (os.environ.get("MASTER_ADDR"), _store_host(store)):
        if host:
            address = _route_to(host)
            if address:
                return address
    try:
        address = socket.gethostbyname(socket.gethostname())
        if not address.startswith("127."):
            return address
    except OSError:
        pass
    return "127.0.0.1"
