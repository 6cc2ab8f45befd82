"""Ray, imported only when a fleet is launched (the ``ray`` extra), and the driver's
connection: a Ray of this machine alone on 127.0.0.1 only (``connect(None)``), or a
cluster started with ``ray start`` (docs/operations.md "A fleet on Ray").
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from types import ModuleType

from asyncdiloco.errors import AsyncDiLoCoError, ConfigError

log = logging.getLogger(__name__)

#: What ``pip install`` brings Ray (pyproject.toml's extra).
RAY_FIX = "pip install 'asyncdiloco[ray]'"

#: Seconds the driver waits for a TCP connection to a cluster's HOST:PORT.
CONNECT_TIMEOUT_S = 5.0

#: Ray's settings for a Ray of this machine alone: loopback only, no usage statistics.
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DISABLE_USAGE_STATS": "1"}


def ray_module() -> ModuleType:
    """The ``ray`` package.

    Raises:
        ConfigError: Ray is not installed (the message gives the install command).
    """
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(f"a fleet runs on Ray, which is not installed here ({exc}); {RAY_FIX}") from None
    return ray


def local_ray_kwargs(num_cpus: float | None) -> dict:
    """``ray.init``'s arguments for a Ray of this machine alone (``LOCAL_RAY_ENV`` must be
    in the environment first): a new local cluster (``address="local"``, never one that
    happens to run here), ``num_cpus`` cores (None: all), on 127.0.0.1, no dashboard,
    Ray's own logging setup left out (the command configures logging)."""
    kwargs: dict = {
        "address": "local",
        "include_dashboard": False,
        "_node_ip_address": "127.0.0.1",
        "configure_logging": False,
    }
    if num_cpus is not None:
        kwargs["num_cpus"] = num_cpus
    return kwargs


def _loopback_only() -> None:
    """``LOCAL_RAY_ENV`` in the environment (inherited by every Ray process this driver
    starts). Ray reads the loopback switch once, when it is imported: if this process
    imported Ray before, its copy of the switch is set to the same value here."""
    for name, value in LOCAL_RAY_ENV.items():
        os.environ.setdefault(name, value)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]


def connect(address: str | None, num_cpus: float | None = None) -> bool:
    """Connect the driver to Ray: the cluster at ``address``, or (None) a new Ray of this
    machine alone with ``num_cpus`` cores. Already connected: nothing changes.

    Returns:
        True if this call started Ray (the caller shuts it down).
    Raises:
        ConfigError: Ray is not installed, or ``num_cpus`` is given with an address.
        AsyncDiLoCoError: no Ray cluster answers at ``address``.
    """
    if address is None:
        _loopback_only()
    ray = ray_module()
    if ray.is_initialized():
        return False
    if address is None:
        try:
            ray.init(**local_ray_kwargs(num_cpus))
        except KeyboardInterrupt:  # Ctrl-C while Ray starts: its agents would outlive this process
            ray.shutdown()
            raise
        log.info("started a local Ray on 127.0.0.1 (%s CPUs)", ray.cluster_resources().get("CPU", 0))
        return True
    if num_cpus is not None:
        raise ConfigError(
            f"--local-cpus {num_cpus:g} is invalid with --address {address}: the cluster's nodes declare their "
            f"own CPUs (ray start --num-cpus); drop --local-cpus"
        )
    os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
    check_reachable(address)
    try:
        ray.init(address=address, configure_logging=False)
    except ConnectionError as exc:  # "auto" with no cluster on this machine, a head that went away
        raise AsyncDiLoCoError(_no_cluster(address, str(exc).splitlines()[0][:200])) from None
    log.info("connected to the Ray cluster at %s: %s", address, ray.cluster_resources())
    return True


def _no_cluster(address: str, why: str) -> str:
    port = address.rsplit(":", 1)[1] if ":" in address and address.rsplit(":", 1)[1].isdigit() else "6379"
    return (
        f"no Ray cluster at {address} ({why}): start one with ray start --head --port {port}, or drop --address "
        f"to run a local one"
    )


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """For an address "HOST:PORT" (or "ray://HOST:PORT", "[IPv6]:PORT"): a TCP connection to
    it within ``timeout_s``, closed at once; other forms ("auto") are left to Ray.

    Raises:
        AsyncDiLoCoError: nothing accepts a connection there (refused, unreachable, timed out).
    """
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        why = f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        raise AsyncDiLoCoError(_no_cluster(address, why.lower())) from None
