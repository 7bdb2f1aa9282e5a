"""ReplicaMesh geometry: local, multi-host and TPU pod meshes, built from constructed topologies."""

import numpy as np
import pytest

from tpu_scale.distribute.mesh import ReplicaMesh, smallest_group_for_span


def make_topology(x, y, z=1, cores=2):
    """A TPU `Topology` of an x*y*z-chip slice with `cores` per chip, built without hardware."""
    import tensorflow as tf  # only the topology tests need it

    coords = np.array(
        [
            [cx, cy, cz, c]
            for cz in range(z)
            for cy in range(y)
            for cx in range(x)
            for c in range(cores)
        ]
    )
    per_task = min(len(coords), 8)
    return tf.tpu.experimental.Topology(
        mesh_shape=[x, y, z, cores], device_coordinates=coords.reshape(-1, per_task, 4)
    )


# Slices from a v2/v3-8 to a full 1024-chip pod, and a v4-like 3-D shape with one core per chip.
SLICES = [
    (2, 2, 1, 2),
    (4, 4, 1, 2),
    (8, 8, 1, 2),
    (16, 8, 1, 2),
    (16, 16, 1, 2),
    (32, 16, 1, 2),
    (32, 32, 1, 2),
    (4, 4, 4, 1),
]


def assert_partition(groups, n, size):
    assert groups.shape == (n // size, size)
    assert sorted(groups.ravel().tolist()) == list(range(n))


def test_row_major_coordinates():
    mesh = ReplicaMesh.from_shape(2, 4)
    assert mesh.shape == (2, 4) and mesh.num_replicas == 8
    assert mesh.coordinates(0) == (0, 0)
    assert mesh.coordinates(5) == (1, 1)
    np.testing.assert_array_equal(mesh.row_groups(), [[0, 1, 2, 3], [4, 5, 6, 7]])
    np.testing.assert_array_equal(mesh.column_groups(), [[0, 4], [1, 5], [2, 6], [3, 7]])


def test_local_and_worker_meshes():
    assert ReplicaMesh.for_devices(8).shape == (1, 8)
    assert ReplicaMesh.for_devices(8, (4, 2)).shape == (4, 2)
    workers = ReplicaMesh.for_workers(3, 4)
    # A row is one host: its replicas are that worker's task * local + i.
    np.testing.assert_array_equal(workers.row_groups()[1], [4, 5, 6, 7])


def test_bad_shapes_name_the_fix():
    with pytest.raises(ValueError, match=r"holds 6 replicas but there are 8.*\(2, 4\)"):
        ReplicaMesh.for_devices(8, (2, 3))
    with pytest.raises(ValueError, match="exactly once"):
        ReplicaMesh([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="outside"):
        ReplicaMesh.from_shape(2, 2).coordinates(4)


@pytest.mark.parametrize("tiled", [False, True])
def test_group_assignments_partition(tiled):
    mesh = ReplicaMesh.from_shape(4, 8)
    for size in (1, 2, 4, 8, 16, 32):
        assert_partition(mesh.group_assignment(size, tiled=tiled), 32, size)


def test_contiguous_groups():
    np.testing.assert_array_equal(
        ReplicaMesh.from_shape(2, 4).group_assignment(2), [[0, 1], [2, 3], [4, 5], [6, 7]]
    )


def test_group_size_that_does_not_divide():
    with pytest.raises(ValueError, match=r"does not divide the 8 replicas.*\[1, 2, 4, 8\]"):
        ReplicaMesh.from_shape(2, 4).group_assignment(3)


def test_group_size_that_does_not_tile():
    # Three cores of a 2-core-per-chip row would split a chip.
    mesh = ReplicaMesh.from_shape(1, 6, cores_per_chip=2, is_torus=True)
    with pytest.raises(ValueError, match=r"cannot tile the 1x6 mesh.*sizes that tile: \[1, 2, 6\]"):
        mesh.group_assignment(3, tiled=True)


@pytest.mark.parametrize("shape", SLICES, ids=lambda s: "x".join(map(str, s)))
def test_pod_meshes_follow_the_torus(shape):
    x, y, z, cores = shape
    topology = make_topology(x, y, z, cores)
    mesh = ReplicaMesh.from_topology(topology)
    n = x * y * z * cores
    assert mesh.num_replicas == n and mesh.is_torus
    assert mesh.shape == (y * z, x * cores)
    coords = topology.device_coordinates.reshape(-1, 4)
    for replica in range(0, n, max(1, n // 16)):
        cx, cy, cz, core = coords[replica]
        assert mesh.coordinates(replica) == (cz * y + cy, cx * cores + core)
    for size in (s for s in (2, 8, 16, 32, 64) if n % s == 0):
        try:
            groups = mesh.group_assignment(size, tiled=True)
        except ValueError:
            continue
        assert_partition(groups, n, size)
        for group in groups:
            rows, cols = zip(*(mesh.coordinates(r) for r in group))
            # A tile is a full rectangle of the mesh.
            assert (max(rows) - min(rows) + 1) * (max(cols) - min(cols) + 1) == size
            if size >= cores:
                # ... made of whole chips: the tile starts and ends on chip boundaries.
                assert min(cols) % cores == 0 and (max(cols) + 1) % cores == 0


@pytest.mark.parametrize(
    "cores_in_group,chips", [(8, (2, 2)), (16, (2, 4)), (32, (4, 4)), (64, (4, 8))]
)
def test_v3_tiles_match_the_reference_shapes(cores_in_group, chips):
    mesh = ReplicaMesh.from_topology(make_topology(32, 32))
    group = mesh.group_assignment(cores_in_group, tiled=True)[0]
    rows = {mesh.coordinates(r)[0] for r in group}
    chip_cols = {mesh.coordinates(r)[1] // 2 for r in group}
    assert (len(rows), len(chip_cols)) == chips


def test_mesh_with_device_assignment():
    topology = make_topology(2, 2)
    import tensorflow as tf

    assignment = tf.tpu.experimental.DeviceAssignment.build(topology, num_replicas=8)
    mesh = ReplicaMesh.from_topology(topology, assignment)
    for replica in range(8):
        cx, cy, _, core = assignment.coordinates(replica, 0)
        assert mesh.coordinates(replica) == (cy, cx * 2 + core)


def test_span_rule():
    mesh = ReplicaMesh.from_shape(4, 8)
    assert smallest_group_for_span(mesh, per_replica_batch=16) == 4
    assert smallest_group_for_span(mesh, per_replica_batch=8) == 8
    assert smallest_group_for_span(mesh, per_replica_batch=128) == 1
    assert smallest_group_for_span(mesh, per_replica_batch=1) == 32
