"""Sizing: the input rate each host must feed, and the batch-norm group spanning enough examples."""

import numpy as np

from tpu_scale.distribute.mesh import smallest_group_for_span


def input_rate(hardware, target_images_per_sec=None):
    """Images per second each host must decode and feed.

    Args:
      hardware: a `Hardware`.
      target_images_per_sec: the whole job's target; default: the node's known training rate times
        nodes (for TPU v3 the paper's ~1,025 img/s per chip).

    Returns:
      dict with the target, and the rate per host, per node and per replica.
    """
    if target_images_per_sec is None:
        target = hardware.images_per_sec_per_node * hardware.num_nodes
        basis = f"{hardware.images_per_sec_per_node:,.0f} img/s per {hardware.node} (see sources)"
    else:
        if not isinstance(target_images_per_sec, (int, float)) or not target_images_per_sec > 0:
            raise ValueError(
                f"target_images_per_sec must be positive, got {target_images_per_sec!r}."
            )
        target, basis = float(target_images_per_sec), "given target"
    return {
        "target_images_per_sec": float(target),
        "basis": basis,
        "hosts": hardware.num_hosts,
        "per_host": target / hardware.num_hosts,
        f"per_{hardware.node}": target / hardware.num_nodes,
        "per_replica": target / hardware.num_replicas,
    }


def suggest_bn_group(mesh, per_core_batch, span=(64, 128)):
    """The smallest topology-tiled BN group whose span (per-core batch x group size) reaches
    `span[0]`.

    The group is `mesh.smallest_group_for_span` (tiled), the rule the layers use; this adds its tile
    shape and how it compares with `span`.

    Args:
      mesh: a `ReplicaMesh`; groups come from `mesh.group_assignment(g, tiled=True)`.
      per_core_batch: examples per replica per step.
      span: `(low, high)` examples normalized together; the authors' team ran 64-128.

    Returns:
      dict with `group_size`, `span`, `in_range`, `tile_replicas` (rows, cols of one group),
      `tile_chips`, `num_groups`, `first_group` and a `note`.
    """
    if (
        isinstance(per_core_batch, bool)
        or not isinstance(per_core_batch, (int, np.integer))
        or per_core_batch < 1
    ):
        raise ValueError(f"per_core_batch must be a positive integer, got {per_core_batch!r}.")
    low, high = span
    n = mesh.num_replicas
    g = smallest_group_for_span(mesh, int(per_core_batch), low, tiled=True)
    groups = mesh.group_assignment(g, tiled=True)
    coords = np.array([mesh.coordinates(int(r)) for r in groups[0]])
    tile = (int(np.ptp(coords[:, 0])) + 1, int(np.ptp(coords[:, 1])) + 1)
    chips = (tile[0], max(1, tile[1] // mesh.cores_per_chip))
    s = g * int(per_core_batch)
    if s < low:
        note = f"even all {n} replicas span only {s} < {low} examples"
    elif s > high and g == 1:
        note = f"the per-core batch alone spans {s} > {high}: plain per-replica batch norm"
    elif s > high:
        note = f"no tiled group spans {low}-{high}; the smallest reaching {low} spans {s}"
    else:
        note = f"span {s} in {low}-{high}"
    return {
        "per_core_batch": int(per_core_batch),
        "group_size": int(g),
        "span": s,
        "in_range": low <= s <= high,
        "tile_replicas": list(tile),
        "tile_chips": list(chips),
        "num_groups": int(groups.shape[0]),
        "first_group": groups[0].tolist(),
        "note": note,
    }
