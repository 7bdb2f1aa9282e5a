"""The replica mesh: the 2-D grid of replicas that grouped batch norm and the torus sum use.

Pure geometry: numpy only, no TensorFlow runtime, so pod-scale shapes can be built and checked
anywhere.

A mesh is an int array `grid[rows, cols]` of replica ids. On a TPU slice the rows and columns follow
the physical torus (the cores of one chip sit next to each other in a row); on GPU/CPU hosts the
rows are hosts and the columns are the host's local devices, so a row never crosses a host boundary.

Reference:
  Ying et al., "Image Classification at Supercomputer Scale", 2018 (arXiv:1811.06992).
"""

import numpy as np


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


class ReplicaMesh:
    """A 2-D grid of replica ids.

    Args:
      grid: int array-like `[rows, cols]` holding every replica id `0..n-1` exactly once.
      cores_per_chip: how many adjacent columns of a row belong to one chip (TPU); 1 elsewhere.
        Tiled groups are measured in chips, so a group never splits a chip unless it is smaller than
        one.
      is_torus: True when rows and columns are physical torus rings (a TPU slice). Grouped batch
        norm then uses topology tiles by default.
    """

    def __init__(self, grid, cores_per_chip=1, is_torus=False):
        grid = np.asarray(grid, dtype=np.int64)
        if grid.ndim != 2 or grid.size == 0:
            raise ValueError(
                f"A replica mesh needs a non-empty 2-D grid of replica ids, got shape {grid.shape}."
            )
        if sorted(grid.ravel().tolist()) != list(range(grid.size)):
            raise ValueError(f"A replica mesh must hold each replica id 0..{grid.size - 1} exactly once, got {grid.tolist()}.")
        if cores_per_chip < 1 or grid.shape[1] % cores_per_chip:
            raise ValueError(
                f"cores_per_chip={cores_per_chip} must divide the mesh's {grid.shape[1]} columns."
            )
        self.grid = grid
        self.grid.setflags(write=False)
        self.cores_per_chip = int(cores_per_chip)
        self.is_torus = bool(is_torus)
        self._coords = np.zeros((grid.size, 2), dtype=np.int64)
        for (r, c), rid in np.ndenumerate(grid):
            self._coords[rid] = (r, c)

    # ----------------------------------------------------------------- construction

    @classmethod
    def from_shape(cls, rows, cols, cores_per_chip=1, is_torus=False):
        """A `rows x cols` mesh numbered row-major: replica `r * cols + c` sits at `(r, c)`."""
        if rows < 1 or cols < 1:
            raise ValueError(f"Mesh shape must be positive, got ({rows}, {cols}).")
        return cls(np.arange(rows * cols).reshape(rows, cols), cores_per_chip, is_torus)

    @classmethod
    def for_devices(cls, num_replicas, shape=None):
        """The mesh of one host's devices: `(1, n)` by default, or the `(rows, cols)` given."""
        if shape is None:
            return cls.from_shape(1, num_replicas)
        rows, cols = (int(s) for s in shape)
        if rows * cols != num_replicas:
            options = ", ".join(f"({d}, {num_replicas // d})" for d in _divisors(num_replicas))
            raise ValueError(f"mesh_shape={tuple(shape)} holds {rows * cols} replicas but there are {num_replicas}; use one of {options}.")
        return cls.from_shape(rows, cols)

    @classmethod
    def for_workers(cls, num_workers, replicas_per_worker):
        """Several hosts: one row per worker, its replicas along it (replica = task * local + i)."""
        return cls.from_shape(num_workers, replicas_per_worker)

    @classmethod
    def from_topology(cls, topology, device_assignment=None):
        """The mesh of a TPU slice, following its physical torus.

        Rows are the torus's second dimension (folded with the third on 3-D slices), columns the
        first dimension times the cores of a chip, so the cores of one chip are neighbours in a row.

        Args:
          topology: a `tf.tpu.experimental.Topology` (anything with `mesh_shape` and
            `device_coordinates`).
          device_assignment: the `tf.tpu.experimental.DeviceAssignment` the strategy uses; replica
            `i` is placed at its logical core 0. Without one, replicas follow the topology's device
            order.
        """
        mesh_shape = [int(s) for s in np.asarray(topology.mesh_shape)]
        if len(mesh_shape) != 4:
            raise ValueError(
                f"Expected a TPU topology mesh_shape [x, y, z, cores], got {mesh_shape}."
            )
        if device_assignment is not None:
            coords = np.asarray(device_assignment.core_assignment)[:, 0, :]
        else:
            coords = np.asarray(topology.device_coordinates).reshape(-1, 4)
        cores = mesh_shape[3]
        # Compact the used coordinates: a sub-slice's device assignment need not start at the
        # origin.
        axes = [np.unique(coords[:, i], return_inverse=True)[1] for i in range(4)]
        extent = [int(a.max()) + 1 for a in axes]
        used_cores = extent[3]
        rows = extent[1] * extent[2]
        cols = extent[0] * used_cores
        if rows * cols != len(coords):
            raise ValueError(f"The {len(coords)} replicas do not fill a full rectangle of the torus (extent x={extent[0]}, y={extent[1]}, z={extent[2]}, cores={used_cores}).")
        grid = np.full((rows, cols), -1, dtype=np.int64)
        for replica, (x, y, z, core) in enumerate(zip(*axes)):
            grid[z * extent[1] + y, x * used_cores + core] = replica
        return cls(grid, cores_per_chip=used_cores if cores > 1 else 1, is_torus=True)

    # ----------------------------------------------------------------- geometry

    @property
    def shape(self):
        return tuple(int(s) for s in self.grid.shape)

    @property
    def num_replicas(self):
        return int(self.grid.size)

    def coordinates(self, replica_id):
        """`(row, col)` of a replica."""
        if not 0 <= replica_id < self.num_replicas:
            raise ValueError(f"Replica id {replica_id} is outside 0..{self.num_replicas - 1}.")
        return tuple(int(v) for v in self._coords[replica_id])

    def row_groups(self):
        """`[rows, cols]`: each row's replicas, a group per row."""
        return np.array(self.grid)

    def column_groups(self):
        """`[cols, rows]`: each column's replicas, a group per column."""
        return np.array(self.grid.T)

    def group_assignment(self, group_size, tiled=False):
        """Partitions the replicas into groups of `group_size`.

        Args:
          group_size: replicas per group; must divide the replica count.
          tiled: False gives contiguous replica ids (`r // group_size`); True gives compact
            rectangles of neighbouring chips (on TPU v3: 8 cores -> 2x2 chips, 16 -> 2x4, 32 ->
            4x4), so a group's sum stays on short links.

        Returns:
          int array `[num_groups, group_size]` of replica ids, each group sorted.
        """
        n = self.num_replicas
        if not isinstance(group_size, (int, np.integer)) or group_size < 1 or n % group_size:
            raise ValueError(f"group_size={group_size} does not divide the {n} replicas; valid group sizes are {_divisors(n)}.")
        group_size = int(group_size)
        if not tiled:
            return np.arange(n).reshape(n // group_size, group_size)
        tile = self._tile_shape(group_size)
        if tile is None:
            valid = [g for g in _divisors(n) if self._tile_shape(g) is not None]
            raise ValueError(f"group_size={group_size} cannot tile the {self.shape[0]}x{self.shape[1]} mesh of {n} replicas ({self.cores_per_chip} cores per chip) into equal rectangles; sizes that tile: {valid}.")
        tr, tc = tile
        rows, cols = self.shape
        groups = [
            np.sort(self.grid[r : r + tr, c : c + tc].ravel())
            for r in range(0, rows, tr)
            for c in range(0, cols, tc)
        ]
        return np.stack(groups)

    def _tile_shape(self, group_size):
        """The most compact `(tile_rows, tile_cols)` rectangle of `group_size` replicas, or None."""
        rows, cols = self.shape
        k = self.cores_per_chip
        best = None
        for tr in _divisors(rows):
            if group_size % tr:
                continue
            tc = group_size // tr
            if cols % tc:
                continue
            # A tile holds whole chips, unless the whole group fits inside one chip.
            if tc % k and not (tr == 1 and k % tc == 0):
                continue
            chips_across = max(tc // k, 1)
            # Smallest perimeter in chips; on ties the longer side runs along the row.
            key = (tr + chips_across, tr > chips_across)
            if best is None or key < best[0]:
                best = (key, (tr, tc))
        return None if best is None else best[1]

    def __eq__(self, other):
        return (
            isinstance(other, ReplicaMesh)
            and np.array_equal(self.grid, other.grid)
            and self.cores_per_chip == other.cores_per_chip
            and self.is_torus == other.is_torus
        )

    def __hash__(self):
        return hash((self.grid.tobytes(), self.grid.shape, self.cores_per_chip, self.is_torus))

    def __repr__(self):
        extra = f", cores_per_chip={self.cores_per_chip}, torus" if self.is_torus else ""
        return f"ReplicaMesh({self.shape[0]}x{self.shape[1]}{extra})"


def smallest_group_for_span(mesh, per_replica_batch, span=64, tiled=False):
    """The smallest valid group size whose span (per-replica batch x group size) reaches `span`
    examples.

    Falls back to all replicas when even the whole mesh spans fewer examples.
    """
    for g in _divisors(mesh.num_replicas):
        if g * per_replica_batch < span:
            continue
        try:
            mesh.group_assignment(g, tiled=tiled)
        except ValueError:
            continue
        return g
    return mesh.num_replicas


def parse_mesh_shape(text, replicas):
    """The one-host mesh of a `ROWSxCOLS` flag (e.g. `"2x4"`), or the squarest for `replicas`
    when `text` is empty.

    Raises:
      ValueError: if `text` is not of the form ROWSxCOLS.
    """
    if not text:
        rows = max(d for d in _divisors(replicas) if d * d <= replicas)
        return rows, replicas // rows
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh_shape={text!r} must look like ROWSxCOLS, e.g. 2x4.") from None
    return rows, cols
