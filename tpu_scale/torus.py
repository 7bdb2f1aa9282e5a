"""The 2-D torus gradient summation: the schedule as plain data, its executor, and the `model.fit` hook.

A 1-D ring all-reduce over N replicas takes 2(N-1) sequential steps. On an R x C mesh the sum is done along
one dimension, then the other: reduce-scatter along rows, all-reduce the 1/C shard along columns, all-gather
along rows: about 2(C-1) + 2(R-1) steps for the same bytes per replica. The bidirectional form splits the
gradient in two halves that run in opposite dimension orders at the same time, so the links of both
dimensions are busy in both phases. On several hosts (rows = hosts) only a 1/C shard crosses the host
boundary: it is a hierarchical all-reduce.

The schedule (`build_schedule`) is data: phases with their groups and bytes. `tpu_scale.plan` prices the same
objects that the executor runs.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992), section 3.3.
"""

import dataclasses

import numpy as np

ALGORITHMS = ("ring", "torus_2d", "torus_2d_bidirectional")

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
      streams: tuple of phase tuples; the streams run at the same time, the phases of a stream in order.
    """

    algorithm: str
    mesh: object
    num_bytes: int
    streams: tuple


def _phases(mesh, order, num_bytes):
    """reduce-scatter along the first dimension, all-reduce the shard along the second, all-gather back."""
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
      num_bytes: gradient bytes per replica; the executor pads buffers so each stream divides evenly.
      algorithm: `"ring"` (one all-reduce over every replica), `"torus_2d"` (rows then columns) or
        `"torus_2d_bidirectional"` (half rows-first, half columns-first, at the same time).

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
        streams = ((Phase(REDUCE_SCATTER, "all", everyone, num_bytes),
                    Phase(ALL_GATHER, "all", everyone, num_bytes // n)),) if n > 1 else ((),)
    elif algorithm == "torus_2d":
        streams = (_phases(mesh, ("rows", "columns"), num_bytes),)
    else:
        half = num_bytes // 2
        streams = (_phases(mesh, ("rows", "columns"), half),
                   _phases(mesh, ("columns", "rows"), num_bytes - half))
    return Schedule(algorithm, mesh, int(num_bytes), tuple(streams))


def install():
    """Makes Keras `model.fit` sum gradients with the torus schedule under strategies that ask for it."""
