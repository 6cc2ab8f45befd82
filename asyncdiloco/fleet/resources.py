"""What a fleet asks of Ray, checked before any actor starts: ``local_num_cpus`` (a local
Ray gets as many logical CPUs as the fleet reserves, when the machine has fewer cores) and
``check_fits`` (every actor must fit on one node, or it is refused naming the group, the
request and what the cluster has; a fleet over the total gets a warning that workers
queue); docs/operations.md "A fleet on Ray".
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from asyncdiloco.errors import ConfigError

if TYPE_CHECKING:
    from asyncdiloco.fleet.spec import FleetSpec

#: Slack for sums of fractional requests (0.1 + 0.2 > 0.3 in floats).
_EPS = 1e-6


def fleet_cpus(spec: FleetSpec) -> float:
    """CPUs the whole fleet reserves: the server's plus ``count × num_cpus`` per group."""
    return spec.server_num_cpus + sum(g.count * g.num_cpus for g in spec.groups)


def local_num_cpus(spec: FleetSpec, local_cpus: float | None, cores: int) -> float:
    """``num_cpus`` of a local Ray for ``spec``: ``local_cpus`` if given, else
    ``max(cores, ⌈fleet_cpus(spec)⌉)``.

    Raises:
        ConfigError: ``local_cpus`` is fewer than the fleet reserves (some workers could
            never start while others run).
    """
    need = fleet_cpus(spec)
    if local_cpus is None:
        return float(max(cores, math.ceil(need - _EPS)))
    if local_cpus < need - _EPS:
        raise ConfigError(
            f"--local-cpus {local_cpus:g} is too few for this fleet: the server reserves {spec.server_num_cpus:g} "
            f"CPUs and the workers {need - spec.server_num_cpus:g} ({_groups_text(spec)}), {need:g} in all; give "
            f"--local-cpus {math.ceil(need - _EPS)} or more, or leave it out (the local Ray then has as many "
            f"logical CPUs as the fleet reserves)"
        )
    return local_cpus


def _groups_text(spec: FleetSpec) -> str:
    return ", ".join(f"{g.name}: {g.count} x {g.num_cpus:g}" for g in spec.groups)


def requests(spec: FleetSpec) -> list[tuple[str, int, dict[str, float]]]:
    """``(what, actors, request of each)`` for the server and each group, in Ray's
    resource names ("CPU", "GPU", custom names); zero amounts left out."""
    asks = [("the server", 1, {"CPU": spec.server_num_cpus, **spec.server_resources})]
    asks += [(f"group {g.name}", g.count, {"CPU": g.num_cpus, "GPU": g.num_gpus, **g.resources}) for g in spec.groups]
    return [(what, n, {k: v for k, v in ask.items() if v > 0}) for what, n, ask in asks]


def check_fits(spec: FleetSpec, nodes: list[dict[str, float]]) -> list[str]:
    """Refuse a request no node can hold; return warnings for a fleet that will queue.

    Args:
        nodes: the resources of each live node of the cluster (``ray.nodes()``'s
            ``Resources`` of the nodes with ``Alive``), e.g. ``[{"CPU": 8.0, "GPU": 1.0}]``.
    Returns:
        Warnings (one line each): the fleet's total exceeds the cluster's.
    Raises:
        ConfigError: some actor's request fits on no node.
    """
    totals: dict[str, float] = {}
    for node in nodes:
        for key, amount in node.items():
            totals[key] = totals.get(key, 0.0) + amount
    need: dict[str, float] = {}
    for what, count, ask in requests(spec):
        if not any(all(node.get(k, 0.0) >= v - _EPS for k, v in ask.items()) for node in nodes):
            raise ConfigError(_refusal(what, ask, nodes, totals))
        for key, amount in ask.items():
            need[key] = need.get(key, 0.0) + count * amount
    return [
        f"the fleet reserves {amount:g} {_unit(key, amount)} in all and the Ray cluster has {totals.get(key, 0.0):g}: "
        f"every worker fits on a node, but some will queue until others finish"
        for key, amount in need.items()
        if amount > totals.get(key, 0.0) + _EPS
    ]


def _refusal(what: str, ask: dict[str, float], nodes: list[dict[str, float]], totals: dict[str, float]) -> str:
    per = " per worker" if what.startswith("group") else ""
    short = [k for k, v in ask.items() if max((n.get(k, 0.0) for n in nodes), default=0.0) < v - _EPS]
    if not short:  # each amount exists somewhere, but never all on one node
        asked = ", ".join(f"{v:g} {_unit(k, v)}" for k, v in ask.items())
        each = [{k: n.get(k, 0.0) for k in ask} for n in nodes]
        return (
            f"{what} asks {asked}{per} on one node, and no node of the Ray cluster has all of it (nodes: {each}): "
            f"ask less per worker, or add a node with all of it"
        )
    key = short[0]
    largest = max((n.get(key, 0.0) for n in nodes), default=0.0)
    has = f"{totals.get(key, 0.0):g} {_unit(key, totals.get(key, 0.0))}"
    if len(nodes) > 1:
        has += f", at most {largest:g} on one node"
    return f"{what} asks {ask[key]:g} {_unit(key, ask[key])}{per}; the Ray cluster has {has}: {_fix(key)}"


def _unit(key: str, amount: float) -> str:
    if key in ("CPU", "GPU"):
        return key if amount == 1 else key + "s"
    return f"of {key!r}"


def _fix(key: str) -> str:
    if key == "GPU":
        return "drop the GPUs from --group or connect to a cluster with GPUs (--address)"
    if key == "CPU":
        return (
            "ask fewer CPUs per worker (--group NAME:COUNT:CPUS:GPUS, --server-cpus), or connect to a cluster "
            "whose nodes have more (ray start --num-cpus N)"
        )
    return f"start a node that has it (ray start --resources '{{\"{key}\": N}}'), or drop it from the request"
