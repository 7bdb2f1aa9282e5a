"""Tests for `tpu_scale.torus.schedule`: the gradient sum as data (numpy only, no TensorFlow)."""

import pytest

from tpu_scale.distribute.mesh import ReplicaMesh
from tpu_scale.torus import schedule as torus


@pytest.mark.parametrize("shape", [(1, 8), (8, 1)])
@pytest.mark.parametrize("algorithm", ["torus_2d", "torus_2d_bidirectional"])
def test_degenerate_mesh_is_a_single_ring(shape, algorithm):
    mesh = ReplicaMesh.from_shape(*shape)
    schedule = torus.build_schedule(mesh, 1024, algorithm)
    everyone = set(range(8))
    for stream in schedule.streams:
        assert stream, "every stream has work on 8 replicas"
        for phase in stream:
            assert phase.groups.shape == (1, 8) and set(phase.groups[0]) == everyone
    assert sum(torus.stream_sizes(schedule)) == 1024


def test_bytes_between_hosts_hierarchical_vs_ring():
    mesh = ReplicaMesh.for_workers(2, 4)
    host = lambda replica: replica // 4  # noqa: E731
    m = 8 * 1024
    hierarchical = torus.bytes_sent_between(torus.build_schedule(mesh, m, "torus_2d"), host)
    # Only the column all-reduce of the 1/4 shard crosses: 4 two-member rings, both edges, M/4 each.
    assert hierarchical == 2 * m
    assert torus.ring_bytes_sent_between(8, m, host) == 2 * 2 * 7 * m // 8
    ring_schedule = torus.bytes_sent_between(torus.build_schedule(mesh, m, "ring"), host)
    assert ring_schedule > hierarchical


def test_auto_algorithm():
    assert torus.resolve_algorithm("auto", mesh=ReplicaMesh.from_shape(2, 4)) == "torus_2d"
    assert (
        torus.resolve_algorithm("auto", mesh=ReplicaMesh.from_shape(2, 4, is_torus=True))
        == "torus_2d_bidirectional"
    )
    assert torus.resolve_algorithm("ring") == "ring"
    with pytest.raises(ValueError, match="choose 'auto' or one of"):
        torus.resolve_algorithm("tree")
    # The hardware create_strategy found: one host sums flat, GPUs with NCCL.
    one_host = ReplicaMesh.from_shape(2, 4)
    assert torus.resolve_algorithm("auto", one_host, "cpu", hosts=1) == "flat"
    assert torus.resolve_algorithm("auto", one_host, "cpu", hosts=2) == "torus_2d"
    assert torus.resolve_algorithm("auto", one_host, "gpu", hosts=1) == "native"
    # Across hosts a small gradient is latency-bound: one all-reduce over every replica.
    assert torus.resolve_algorithm("auto", one_host, "cpu", hosts=2, gradient_bytes=264) == "flat"
    big = torus.SMALL_GRADIENT_BYTES
    assert torus.resolve_algorithm("auto", one_host, "cpu", hosts=2, gradient_bytes=big) == "torus_2d"


_MEASURED = [
    dict(kind="cpu", replicas_per_host=8, mesh_shape=(1, 8)),
    dict(kind="cpu", replicas_per_host=8, mesh_shape=(2, 4)),
    dict(kind="cpu", hosts=2, replicas_per_host=4),
    dict(kind="gpu", replicas_per_host=8),
    dict(kind="gpu", hosts=4, replicas_per_host=8),
]


# On GPUs a sum of a few hundred bytes costs the same every way (the planner prices all options at
# 0.0-0.1 ms): the rule keeps NCCL there, and the tiny gradient is compared on CPU hosts only.
@pytest.mark.parametrize(
    "hardware, gradient",
    [(h, "resnet50") for h in _MEASURED] + [(h, "tiny") for h in _MEASURED if h["kind"] == "cpu"],
)
def test_auto_rule_agrees_with_the_planner_where_it_was_measured(hardware, gradient):
    # The rule decides at run time; the planner prices every option for the same hardware and, on
    # the hardware the benchmarks measured (and GPUs), picks the same: for ResNet-50's gradient,
    # and for a model of four small tensors (tests/test_torus_multiworker.py's).
    from tpu_scale.plan import choice

    priced = choice.hardware_cluster(**hardware)
    if gradient == "resnet50":  # 25.6 M float32 values in tensors of its layers' sizes
        sizes = [9408, 64, 64] + [36864] * 40 + [147456] * 40 + [589824] * 40 + [2359296] * 30
        sizes.append(2048000)
    else:
        sizes = [35, 7, 21, 3]
    tensors = [(4 * n, "float32") for n in sizes]
    planned = choice.choose_algorithm(priced, tensors).algorithm
    ruled = torus.resolve_algorithm(
        "auto", priced.mesh, hardware["kind"], hardware.get("hosts", 1), 4 * sum(sizes)
    )
    assert ruled == planned


@pytest.mark.parametrize("algorithm", torus.ALGORITHMS)
def test_padded_length_splits_every_stream_into_shards(algorithm):
    mesh = ReplicaMesh.from_shape(2, 4)
    for length in (1, 7, 8, 15, 16, 1003):
        padded = torus.padded_length(length, mesh, algorithm)
        assert length <= padded < length + 8 * 2
        schedule = torus.build_schedule(mesh, padded * 4, algorithm)
        buffered = torus.buffer_schedule(mesh, length * 4, 4, algorithm)
        assert [[(p.kind, p.bytes_in) for p in s] for s in buffered.streams] == [
            [(p.kind, p.bytes_in) for p in s] for s in schedule.streams
        ]
        for stream in schedule.streams:
            for phase in stream:
                if phase.kind == torus.REDUCE_SCATTER:  # the only phase that cuts its input
                    assert (phase.bytes_in // 4) % phase.group_size == 0, (length, phase)
        if algorithm == "flat":
            assert padded == length  # one all-reduce: nothing to split, nothing to pad


def test_pack_indices():
    assert torus.pack_indices([10, 10, 10], pack_bytes=25) == [[0, 1], [2]]
    assert torus.pack_indices([40, 5], pack_bytes=25) == [[0], [1]]
    assert torus.pack_indices([10, 10], pack_bytes=None) == [[0, 1]]


def test_schedule_needs_no_tensorflow():
    import subprocess
    import sys

    # A machine without TensorFlow or Keras: importing either fails, the planner still imports.
    code = (
        "import sys; sys.modules['tensorflow'] = sys.modules['keras'] = None\n"
        "import tpu_scale.torus.schedule, tpu_scale.plan; print(tpu_scale.plan.__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "tpu_scale.plan"


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (1, 8)])
@pytest.mark.parametrize("algorithm", torus.ALGORITHMS)
def test_sharded_streams_leave_each_replica_one_chunk(shape, algorithm):
    mesh = ReplicaMesh.from_shape(*shape)
    schedule = torus.build_schedule(mesh, 8 * 64, algorithm)
    cut = torus.sharded_streams(schedule)
    assert len(cut) == len(schedule.streams)
    for (scatter, gather), stream in zip(cut, schedule.streams):
        # No all-reduce is left; the gathers undo the scatters in reverse, over the same groups.
        assert scatter and all(p.kind == torus.REDUCE_SCATTER for p in scatter)
        assert all(p.kind == torus.ALL_GATHER for p in gather)
        assert [p.dimension for p in gather] == [p.dimension for p in reversed(scatter)]
        assert scatter[0].bytes_in == stream[0].bytes_in == gather[-1].bytes_out
        assert scatter[-1].bytes_out == gather[0].bytes_in == stream[0].bytes_in // 8
        # Each of the 8 chunks is held by exactly one replica.
        positions = [torus.shard_position(scatter, k) for k in range(8)]
        assert sorted(positions) == list(range(8))


def test_shard_position_reads_the_ranks_as_digits():
    mesh = ReplicaMesh.from_shape(2, 4)  # replica 6 sits at row 1, column 2
    rows_first, columns_first = torus.sharded_streams(
        torus.build_schedule(mesh, 1024, "torus_2d_bidirectional")
    )
    assert torus.shard_position(rows_first[0], 6) == 2 * 2 + 1  # rank 2 of 4, then rank 1 of 2
    assert torus.shard_position(columns_first[0], 6) == 1 * 4 + 2
    # Another rank order (here: each group's members reversed) moves the chunks with it.
    reverse = lambda members, replica: len(members) - 1 - members.index(replica)  # noqa: E731
    assert torus.shard_position(rows_first[0], 6, reverse) == 1 * 2 + 0
