"""The cost model: prices a `torus_schedule.Schedule` on a `Hardware` with an alpha-beta event
simulation.

Details of the model are in `price_schedule`; the package docstring has the summary.
"""

import dataclasses

import numpy as np

from tpu_scale.plan.catalog import Hardware, Link  # noqa: F401  (Hardware: named in docstrings)
from tpu_scale.torus import schedule as torus_schedule


@dataclasses.dataclass(frozen=True)
class _Part:
    """A piece of a phase: its latency, then `nbytes` over `link` (the link that bounds the
    transfer).

    `steps` and `local_steps` count the critical path's steps between nodes and inside a node;
    `remote_bytes` is what each node sends to other nodes, `local_bytes` what each replica sends
    inside its node.
    """

    latency: float
    link: Link
    nbytes: float
    steps: int
    local_steps: int
    remote_bytes: float
    local_bytes: float


def _group_layout(phase, node_ids):
    """`(k, m, groups_per_node)`: nodes a group spans, replicas per node in it, groups touching a
    node."""
    nodes = node_ids[phase.groups]
    k = max(len(np.unique(row)) for row in nodes)
    m = max(int(np.bincount(row).max()) for row in nodes)
    touching = np.zeros(int(node_ids.max()) + 1, dtype=np.int64)
    for row in nodes:
        touching[np.unique(row)] += 1
    return k, m, int(touching.max())


def _local_part(hardware, m, full):
    """A ring of the `m` replicas of one node: `m - 1` steps, `(m - 1) / m` of the data each."""
    nbytes = (m - 1) / m * full
    return _Part((m - 1) * hardware.local.alpha, hardware.local, nbytes, 0, m - 1, 0.0, nbytes)


def in_graph_load(phase, host_ids):
    """`(handoffs, traffic_bytes)` of one in-graph phase on its busiest host.

    Per group of `g`, with `B` the phase's input per replica: a sum on the first member hands `g -
    1` values to it and the result back to `g - 1` members; a reduce-scatter hands each member `g -
    1` chunks and an all-gather `g - 1` shards: `g (g - 1)` hand-offs, each a send/receive pair
    between two CPU devices in TensorFlow's executor (it copies nothing). Memory: a sum and a
    reduce-scatter read every member's `B` and write `B` (`(g + 1) B`), an all-gather writes and
    reads the gathered `g B` on each member (`2 g^2 B`). The groups of one host add up.
    """
    g = phase.group_size
    per_host = int(np.bincount(host_ids[phase.groups[:, 0]]).max())
    if phase.kind == torus_schedule.ALL_GATHER:
        traffic = 2 * g * g * phase.bytes_in
    else:
        traffic = (g + 1) * phase.bytes_in
    handoffs = 2 * (g - 1) if phase.kind == torus_schedule.ALL_REDUCE else g * (g - 1)
    return per_host * handoffs, float(per_host * traffic)


def _in_graph_parts(phase, hardware, host_ids):
    """A phase the executor builds from plain ops on one CPU host: its hand-offs on the host's cores
    (`host_memory.alpha` seconds each), then its memory traffic (`in_graph_load`). Both are shared
    resources: concurrent streams of one host share its cores and its memory bandwidth.
    """
    handoffs, traffic = in_graph_load(phase, host_ids)
    memory = hardware.host_memory
    parts = [_Part(0.0, memory, traffic, 0, 0, 0.0, 0.0)]
    if memory.alpha > 0:
        cores = Link("host_cores", 0.0, 1.0 / memory.alpha)
        parts.insert(0, _Part(0.0, cores, float(handoffs), 0, 0, 0.0, 0.0))
    return parts


def _phase_parts(phase, hardware, node_ids):
    """The parts of one phase, in execution order.

    Two-level (TPU): a chip's replicas combine on chip, the chips form a ring, so a group of `k`
    chips costs `k - 1` steps per pass whatever the cores per chip. Flat (`hardware.flat_rings`,
    NCCL-style GPU rings): one ring through every replica, `g - 1` steps per pass, `k - 1` of them
    between hosts and `g - k` over NVLink, each host sending `(g - 1) / g` of the data per pass on
    its one outgoing network edge.
    """
    k, m, per_node = _group_layout(phase, node_ids)
    g = phase.group_size
    # The data one group moves around its ring: the whole vector for a reduce-scatter or an
    # all-reduce, the gathered vector for an all-gather.
    full = phase.bytes_out if phase.kind == torus_schedule.ALL_GATHER else phase.bytes_in
    passes = 2 if phase.kind == torus_schedule.ALL_REDUCE else 1
    remote = hardware.links[phase.dimension]
    if hardware.flat_rings and k > 1 and m > 1:
        remote_bytes = per_node * passes * (g - 1) / g * full
        local_bytes = passes * (g - 1) / g * full
        steps, local_steps = passes * (k - 1), passes * (g - k)
        latency = steps * remote.alpha + local_steps * hardware.local.alpha
        # Both kinds of link carry the ring's chunks at the same time; the slower one bounds the
        # transfer.
        if remote_bytes / remote.bandwidth >= local_bytes / hardware.local.bandwidth:
            link, nbytes = remote, remote_bytes
        else:
            link, nbytes = hardware.local, local_bytes
        return [_Part(latency, link, nbytes, steps, local_steps, remote_bytes, local_bytes)]
    parts = []
    if m > 1 and phase.kind in (torus_schedule.REDUCE_SCATTER, torus_schedule.ALL_REDUCE):
        parts.append(_local_part(hardware, m, full))
    if k > 1:
        steps = passes * (k - 1)
        nbytes = per_node * passes * (k - 1) / k * full
        parts.append(_Part(steps * remote.alpha, remote, nbytes, steps, 0, nbytes, 0.0))
    if m > 1 and phase.kind in (torus_schedule.ALL_GATHER, torus_schedule.ALL_REDUCE):
        parts.append(_local_part(hardware, m, full))
    return parts


def _simulate(streams):
    """Seconds until every stream is done; concurrent transfers on one link name share its bandwidth
    fairly.

    Args:
      streams: list of lists of segments `("delay", seconds)` or `("send", link, bytes)`.
    """
    cursor = [0] * len(streams)
    left = [None] * len(streams)

    def load(i):
        while cursor[i] < len(streams[i]):
            seg = streams[i][cursor[i]]
            amount = seg[1] if seg[0] == "delay" else seg[2]
            if amount > 0:
                left[i] = amount
                return
            cursor[i] += 1
        left[i] = None

    for i in range(len(streams)):
        load(i)
    now = 0.0
    while True:
        active = [i for i in range(len(streams)) if left[i] is not None]
        if not active:
            return now
        users = {}
        for i in active:
            seg = streams[i][cursor[i]]
            if seg[0] == "send":
                users[seg[1].name] = users.get(seg[1].name, 0) + 1
        rate = {}
        for i in active:
            seg = streams[i][cursor[i]]
            rate[i] = 1.0 if seg[0] == "delay" else seg[1].bandwidth / users[seg[1].name]
        dt = min(left[i] / rate[i] for i in active)
        now += dt
        for i in active:
            left[i] -= rate[i] * dt
            if left[i] <= 1e-12 * max(1.0, rate[i] * dt) or left[i] / rate[i] <= 1e-15:
                cursor[i] += 1
                load(i)


def price_schedule(schedule, hardware, in_graph=True):
    """Predicted cost of one `torus_schedule.Schedule` on `hardware`.

    Args:
      schedule: a `Schedule` from `torus_schedule.build_schedule` on `hardware.mesh`.
      hardware: a `Hardware`.
      in_graph: with `hardware.host_memory` (CPU hosts), price the phases whose groups sit on one
        host as the executor's plain in-graph ops; False prices every phase as a collective.

    Returns:
      dict with `steps` (sequential steps between nodes on the critical path: 2(N-1) for a ring over
      N nodes, 2(X-1)+2(Y-1) for the 2-D forms), `local_steps` (on-chip / NVLink steps),
      `bytes_per_node` (bytes each node sends to other nodes), `local_bytes_per_replica`, `seconds`
      (all streams done), `latency_seconds` (the critical path's steps times alpha) and
      `transfer_seconds` (the rest).
    """
    if schedule.mesh.num_replicas != hardware.num_replicas:
        raise ValueError(f"The schedule's mesh has {schedule.mesh.num_replicas} replicas but the hardware {hardware.name!r} has {hardware.num_replicas}; build the schedule on hardware.mesh.")
    node_ids = hardware.node_ids()
    host_ids = hardware.host_ids()
    in_graph = in_graph and hardware.host_memory is not None
    steps, local_steps, latency = 0, 0, 0.0
    remote_bytes, local_bytes = 0.0, 0.0
    segments = []
    for stream in schedule.streams:
        s_steps = s_local = 0
        s_latency = 0.0
        segs = []
        for phase in stream:
            local = in_graph and torus_schedule.phase_within_hosts(phase, lambda r: host_ids[r])
            if hardware.phase_overhead and not local:
                segs.append(("delay", hardware.phase_overhead))
                s_latency += hardware.phase_overhead
            parts = (
                _in_graph_parts(phase, hardware, host_ids)
                if local
                else _phase_parts(phase, hardware, node_ids)
            )
            for part in parts:
                segs.append(("delay", part.latency))
                segs.append(("send", part.link, part.nbytes))
                s_latency += part.latency
                s_steps += part.steps
                s_local += part.local_steps
                remote_bytes += part.remote_bytes
                local_bytes += part.local_bytes
        segments.append(segs)
        steps, local_steps = max(steps, s_steps), max(local_steps, s_local)
        latency = max(latency, s_latency)
    seconds = _simulate(segments)
    return {
        "steps": int(steps),
        "local_steps": int(local_steps),
        "bytes_per_node": float(remote_bytes),
        "local_bytes_per_replica": float(local_bytes),
        "seconds": float(seconds),
        "latency_seconds": float(latency),
        "transfer_seconds": float(max(seconds - latency, 0.0)),
    }


def price_algorithms(hardware, num_bytes, algorithms=torus_schedule.ALGORITHMS):
    """`{algorithm: price_schedule(...)}` for `num_bytes` of gradient per replica on `hardware`."""
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, (int, np.integer)) or num_bytes < 0:
        raise ValueError(f"num_bytes must be a non-negative integer, got {num_bytes!r}.")
    return {
        alg: price_schedule(
            torus_schedule.build_schedule(hardware.mesh, int(num_bytes), alg), hardware
        )
        for alg in algorithms
    }


def pack_sizes(tensor_bytes, pack_bytes=torus_schedule.DEFAULT_PACK_BYTES):
    """Bytes of the buffers `torus_schedule.all_reduce_sum` fuses a list of same-dtype gradients
    into (its own rule)."""
    tensor_bytes = list(tensor_bytes)
    return [
        sum(tensor_bytes[p] for p in pack)
        for pack in torus_schedule.pack_indices(tensor_bytes, pack_bytes)
    ]
