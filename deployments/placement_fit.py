"""Whether a parallel replica's placement group could be placed on the cluster's nodes at all, at
deploy time: otherwise Serve would wait for it for ever, with the app stuck deploying. Judged on
the nodes' total resources (what is free changes); a cluster that adds nodes on demand (Ray's
autoscaler) is judged as it is now."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

Resources = Mapping[str, float]


def check_fits(bundles: Sequence[Resources], strategy: str, nodes: Sequence[Resources], what: str) -> None:
    """ValueError naming `what` (the settings that ask for the bundles) where no placement exists:
    STRICT_PACK needs one node for every bundle, STRICT_SPREAD a node for each, PACK and SPREAD
    any node for each (first fit, largest bundle first)."""
    if strategy == "STRICT_PACK":
        total: dict[str, float] = {}
        for bundle in bundles:
            for key, amount in bundle.items():
                total[key] = total.get(key, 0.0) + amount
        if not any(_holds(node, total) for node in nodes):
            raise ValueError(f"{what}: no node holds {_show(total)} (placement_strategy STRICT_PACK)")
        return
    left = [dict(node) for node in nodes]
    for bundle in sorted(bundles, key=lambda b: -sum(b.values())):
        fits = [node for node in left if _holds(node, bundle)]
        if not fits:
            raise ValueError(
                f"{what}: {len(bundles)} bundles do not fit the cluster's {len(nodes)} nodes, "
                f"{_show(bundle)} finds no room (placement_strategy {strategy})"
            )
        node = fits[0]
        if strategy == "STRICT_SPREAD":
            left.remove(node)
        else:
            for key, amount in bundle.items():
                node[key] -= amount


def _holds(node: Resources, need: Resources) -> bool:
    return all(node.get(key, 0.0) >= amount for key, amount in need.items() if amount > 0)


def _show(resources: Resources) -> str:
    return "{" + ", ".join(f"{key}: {amount:g}" for key, amount in resources.items()) + "}"


def cluster_nodes() -> list[dict[str, float]]:
    """The live nodes' total resources, when this process is attached to a Ray cluster."""
    import ray

    return [node["Resources"] for node in ray.nodes() if node.get("Alive")]
