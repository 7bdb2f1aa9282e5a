"""The 2-D torus gradient sum as plain data: phases, their groups and bytes (numpy only).

A 1-D ring all-reduce over N replicas takes 2(N-1) sequential steps. On an R x C mesh the sum is
done along one dimension, then the other: reduce-scatter along rows, all-reduce the 1/C shard along
columns, all-gather along rows: about 2(C-1) + 2(R-1) steps for the same bytes per replica. The
bidirectional form splits the gradient in two halves that run in opposite dimension orders at the
same time, so the links of both dimensions are busy in both phases. On several hosts (rows = hosts)
only a 1/C shard crosses the host boundary: it is a hierarchical all-reduce.

A `Schedule` is data: the executor (`tpu_scale.torus.all_reduce.all_reduce_sum`) runs it with the
`tpu_scale.distribute.collectives` primitives and the planner (`tpu_scale.plan`) prices the same objects. The
rules both must agree on live here too: how gradients are fused into buffers (`pack_indices`), how a
buffer is padded (`padded_length`, and `buffer_schedule`: the padded buffer's schedule) and which
algorithm "auto" means (`resolve_algorithm`).

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.3.
"""

import dataclasses

import numpy as np

# The in-graph sums this module builds schedules for: the one list of them.
ALGORITHMS = ("ring", "torus_2d", "torus_2d_bidirectional", "flat")
# Those and "native", TensorFlow's own all-reduce: every option a sum can run (what the planner
# prices, and what `resolve_algorithm` may return).
ALGORITHMS_AND_NATIVE = ALGORITHMS + ("native",)
# Those and "auto" (`resolve_algorithm`'s rule): every `gradient_algorithm` a strategy accepts.
GRADIENT_ALGORITHMS = ("auto",) + ALGORITHMS_AND_NATIVE

REDUCE_SCATTER = "reduce_scatter"
ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"


@dataclasses.dataclass(frozen=True)
class Phase:
    """One collective step of a schedule, run by every replica in its group.

    Attributes:
      kind: `"reduce_scatter"`, `"all_reduce"` or `"all_gather"`.
      dimension: `"rows"`, `"columns"` or `"all"` (the whole mesh as one ring).
      groups: int `[num_groups, group_size]` replica ids.
      bytes_in: bytes each replica holds when the phase starts (the shard for an all-gather).
    """

    kind: str
    dimension: str
    groups: np.ndarray
    bytes_in: int

    @property
    def group_size(self):
        return int(self.groups.shape[1])

    @property
    def bytes_out(self):
        if self.kind == REDUCE_SCATTER:
            return self.bytes_in // self.group_size
        if self.kind == ALL_GATHER:
            return self.bytes_in * self.group_size
        return self.bytes_in


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A gradient summation as concurrent streams of phases.

    Attributes:
      algorithm: one of `ALGORITHMS`.
      mesh: the `ReplicaMesh` it runs on.
      num_bytes: bytes of gradient each replica contributes (after padding).
      streams: tuple of phase tuples; the streams run at the same time, the phases of a stream in
        order.
    """

    algorithm: str
    mesh: object
    num_bytes: int
    streams: tuple


def _phases(mesh, order, num_bytes):
    """reduce-scatter along the first dimension, all-reduce the shard along the second, all-gather
    back."""
    groups = {"rows": mesh.row_groups(), "columns": mesh.column_groups()}
    first, second = order
    size = groups[first].shape[1]
    phases = [
        Phase(REDUCE_SCATTER, first, groups[first], num_bytes),
        Phase(ALL_REDUCE, second, groups[second], num_bytes // size),
        Phase(ALL_GATHER, first, groups[first], num_bytes // size),
    ]
    # A dimension of length 1 has nothing to do: a 1 x n or n x 1 mesh reduces to a single ring.
    return tuple(p for p in phases if p.group_size > 1)


def build_schedule(mesh, num_bytes, algorithm="torus_2d_bidirectional"):
    """The schedule that sums `num_bytes` of gradient per replica over `mesh`.

    Args:
      mesh: a `ReplicaMesh`.
      num_bytes: gradient bytes per replica; the executor pads buffers so each stream divides
        evenly.
      algorithm: `"ring"` (reduce-scatter then all-gather over every replica), `"torus_2d"` (rows
        then columns), `"torus_2d_bidirectional"` (half rows-first, half columns-first, at the same
        time) or `"flat"` (one all-reduce phase over every replica: on one CPU host the executor
        sums it on one device in the step graph, TensorFlow's `ReductionToOneDevice` form; elsewhere
        it is one collective all-reduce, TensorFlow's default form).

    Returns:
      A `Schedule`.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm={algorithm!r}; choose one of {ALGORITHMS}.")
    if num_bytes < 0:
        raise ValueError(f"num_bytes must be >= 0, got {num_bytes}.")
    n = mesh.num_replicas
    if algorithm == "ring":
        everyone = np.arange(n).reshape(1, n)
        streams = (
            (
                (
                    Phase(REDUCE_SCATTER, "all", everyone, num_bytes),
                    Phase(ALL_GATHER, "all", everyone, num_bytes // n),
                ),
            )
            if n > 1
            else ((),)
        )
    elif algorithm == "flat":
        everyone = np.arange(n).reshape(1, n)
        streams = ((Phase(ALL_REDUCE, "all", everyone, num_bytes),),) if n > 1 else ((),)
    elif algorithm == "torus_2d":
        streams = (_phases(mesh, ("rows", "columns"), num_bytes),)
    else:
        half = num_bytes // 2
        streams = (
            _phases(mesh, ("rows", "columns"), half),
            _phases(mesh, ("columns", "rows"), num_bytes - half),
        )
    return Schedule(algorithm, mesh, int(num_bytes), tuple(streams))


def phase_within_hosts(phase, host_of):
    """True when every group of `phase` sits on one host (`host_of`: replica id -> host id).

    Such a phase needs no network: the executor builds it from plain ops in the step graph on CPU
    hosts (`collectives.in_graph_groups`) and the planner prices it on the host's memory.
    """
    return all(len({host_of(int(m)) for m in members}) == 1 for members in phase.groups)


def phase_between_hosts(phase, host_of):
    """True when every member of every group of `phase` sits on a host of its own (e.g. a mesh
    column).

    Such a phase only adds values from different hosts: the one a 16-bit transport dtype may carry
    while every sum within a host stays in the gradient's dtype.
    """
    return (
        all(len({host_of(int(m)) for m in members}) == len(members) for members in phase.groups)
        and phase.group_size > 1
    )


def transport_schedule(schedule, host_of, itemsize, transport_itemsize):
    """`schedule` with its phases between hosts carrying `transport_itemsize`-byte values.

    The executor casts a buffer to the transport dtype (e.g. bfloat16) before a phase whose groups
    hold one member per host (`phase_between_hosts`) and back after it; every other phase keeps the
    gradient's own dtype, so sums within a host stay exact to it. The planner prices the result.
    """
    if transport_itemsize >= itemsize:
        return schedule
    streams = tuple(
        tuple(
            dataclasses.replace(p, bytes_in=p.bytes_in * transport_itemsize // itemsize)
            if phase_between_hosts(p, host_of)
            else p
            for p in stream
        )
        for stream in schedule.streams
    )
    return dataclasses.replace(schedule, streams=streams)


def stream_sizes(schedule):
    """Bytes each stream of `schedule` sums (its first phase's input); they add up to
    `schedule.num_bytes`."""
    if not any(schedule.streams):
        return tuple(schedule.num_bytes if i == 0 else 0 for i in range(len(schedule.streams)))
    return tuple(stream[0].bytes_in if stream else 0 for stream in schedule.streams)


def sharded_streams(schedule):
    """`schedule` cut around a sharded weight update (`tpu_scale.torus.weight_update`): per stream, the
    phases that leave each replica the sum of 1/N of the stream's buffer, and those that bring the
    updated 1/N back.

    An all-reduce phase becomes a reduce-scatter over the same groups, and the all-gathers come after
    the update, in the reverse order of the reduce-scatters: `"torus_2d"` is reduce-scatter along
    rows, then down columns, [update], all-gather down columns, then along rows; `"ring"` and
    `"flat"` are one reduce-scatter over every replica and one all-gather.

    Returns:
      A tuple, per stream, of `(scatter, gather)`: two tuples of `Phase`.
    """
    out = []
    for stream in schedule.streams:
        scatter, num_bytes = [], stream[0].bytes_in if stream else 0
        for phase in stream:
            if phase.kind == ALL_GATHER:
                break
            scatter.append(Phase(REDUCE_SCATTER, phase.dimension, phase.groups, num_bytes))
            num_bytes //= phase.group_size
        gather = tuple(
            Phase(ALL_GATHER, p.dimension, p.groups, p.bytes_out) for p in reversed(scatter)
        )
        out.append((tuple(scatter), gather))
    return tuple(out)


def shard_position(scatter, replica, rank=None):
    """Which of a stream buffer's N equal chunks `replica` holds after the `scatter` phases.

    A reduce-scatter over a group of `g` leaves its member of rank `r` the `r`-th of `g` chunks of
    what it held, so the position is the ranks read as digits: `r1 * g2 + r2` for two phases.

    Args:
      scatter: reduce-scatter phases (`sharded_streams`).
      replica: a replica id.
      rank: callable `(members, replica) -> rank` in the collective runtime's order; by default the
        replica's position in its group's row (the order of in-graph and TPU groups).
    """
    position = 0
    for phase in scatter:
        members = [int(m) for m in phase.groups[np.any(phase.groups == replica, axis=1)][0]]
        r = rank(members, replica) if rank is not None else members.index(replica)
        position = position * phase.group_size + r
    return position


def bytes_sent_between(schedule, host_of):
    """Bytes a schedule sends from one host to another, summed over every replica.

    The count follows how the collective-op runtime moves data: a reduce-scatter (all-to-all) sends
    each other member of the group its `1/g` chunk directly; an all-reduce runs a ring over the
    group in replica order (reduce-scatter then all-gather around the ring: `2 (g - 1) / g` of the
    input on every ring edge); an all-gather also runs a ring (`(g - 1)` shards on every edge). Only
    messages whose sender and receiver sit on different hosts count.

    Args:
      schedule: a `Schedule`.
      host_of: callable, replica id -> host id.

    Returns:
      int bytes, over all hosts and both directions.
    """
    total = 0
    for stream in schedule.streams:
        for phase in stream:
            g = phase.group_size
            for members in phase.groups:
                hosts = [host_of(int(m)) for m in members]
                if phase.kind == REDUCE_SCATTER:
                    pairs = sum(a != b for a in hosts for b in hosts)
                    total += pairs * (phase.bytes_in // g)
                else:
                    ring_edges = sum(hosts[i] != hosts[(i + 1) % g] for i in range(g))
                    per_edge = (
                        2 * (g - 1) * phase.bytes_in // g
                        if phase.kind == ALL_REDUCE
                        else (g - 1) * phase.bytes_in
                    )
                    total += ring_edges * per_edge
    return int(total)


def ring_bytes_sent_between(num_replicas, num_bytes, host_of):
    """Bytes a single ring all-reduce over replicas `0..n-1` sends between hosts (TensorFlow's
    default).

    Each of the `n` ring edges carries `2 (n - 1) / n` of the buffer (reduce-scatter then
    all-gather).
    """
    n = num_replicas
    edges = sum(host_of(i) != host_of((i + 1) % n) for i in range(n))
    return int(edges * 2 * (n - 1) * num_bytes // n) if n > 1 else 0


DEFAULT_ALGORITHM = "auto"
DEFAULT_PACK_BYTES = 32 * 1024 * 1024


# Below this many bytes a gradient sum across hosts is latency-bound: one all-reduce over every
# replica beats the hierarchical form's three phases (the planner's crossover on CPU hosts lies
# between 64 and 256 KiB).
SMALL_GRADIENT_BYTES = 64 * 1024


def resolve_algorithm(algorithm, mesh=None, device_kind=None, hosts=None, gradient_bytes=None):
    """The concrete algorithm for `"auto"`: a fixed rule, the choices the measurements support.

    - a physical torus (`mesh.is_torus`, a TPU slice): `"torus_2d_bidirectional"`, which keeps
      the links of both dimensions busy in both phases;
    - GPUs (`device_kind="gpu"`): `"native"`, TensorFlow's NCCL all-reduce, which the planner
      prices below every torus phase on one host and across hosts;
    - all replicas on one host (`hosts=1`): `"flat"`, one sum in the step's graph (measured at
      0.80 of TensorFlow's fastest option on 8 CPU replicas, `benchmarks/README.md`);
    - several hosts, or what is not known: `"torus_2d"`, rows first, the hierarchical all-reduce:
      only a `1/cols` shard of the gradients leaves a host (measured at 0.58 of TensorFlow's
      default on two processes); but `"flat"` for a gradient under `SMALL_GRADIENT_BYTES`, whose
      sum is latency-bound.

    `tpu_scale.plan` prices every option for given hardware (`python -m tpu_scale.plan`) and
    agrees with this rule on the hardware it has figures for; the rule decides at run time.

    Args:
      algorithm: `"auto"` or one of `ALGORITHMS` (returned as given).
      mesh: the `ReplicaMesh` the sum runs on.
      device_kind: `"cpu"`, `"gpu"` or `"tpu"`, where known.
      hosts: how many hosts the replicas are on, where known.
      gradient_bytes: the whole gradient's size, where known.

    Returns:
      One of `ALGORITHMS`, or `"native"` (for `"auto"` on GPUs).
    """
    if algorithm != "auto":
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={algorithm!r}; choose 'auto' or one of {ALGORITHMS}.")
        return algorithm
    if mesh is not None and mesh.is_torus:
        return "torus_2d_bidirectional"
    if device_kind == "gpu":
        return "native"
    if hosts == 1 or (gradient_bytes is not None and gradient_bytes < SMALL_GRADIENT_BYTES):
        return "flat"
    return "torus_2d"


def pack_indices(tensor_bytes, pack_bytes=DEFAULT_PACK_BYTES):
    """Splits same-dtype tensors of these byte sizes, in order, into fused buffers: lists of
    positions.

    A new buffer starts when the next tensor would take the current one past `pack_bytes` (a larger
    tensor gets a buffer of its own); `None` or 0 puts everything in one buffer. The executor packs
    with this rule and `tpu_scale.plan` prices the buffers it gives.
    """
    packs, current, size = [], [], 0
    for position, nbytes in enumerate(tensor_bytes):
        if current and pack_bytes and size + nbytes > pack_bytes:
            packs.append(current)
            current, size = [], 0
        current.append(position)
        size += nbytes
    packs.append(current)
    return packs


def padded_length(length, mesh, algorithm):
    """The length a flat buffer of `length` elements is padded to before `algorithm` sums it on
    `mesh`.

    Every stream's share must split into shards for every group it meets: a multiple of all replicas
    per stream does. The executor pads with this rule and the planner prices the padded buffers.
    """
    if algorithm == "flat":
        return length  # an all-reduce splits nothing
    quantum = mesh.num_replicas * len(build_schedule(mesh, 0, algorithm).streams)
    return -(-length // quantum) * quantum


def buffer_schedule(mesh, num_bytes, itemsize, algorithm):
    """The schedule the executor runs for one fused buffer of `num_bytes` (values of `itemsize`
    bytes), padded by `padded_length`: what the planner prices and the benchmarks count."""
    length = padded_length(num_bytes // itemsize, mesh, algorithm)
    return build_schedule(mesh, length * itemsize, algorithm)
