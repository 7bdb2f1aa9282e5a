"""Tests of the pod-scale planner: closed forms, orderings, the paper's figures, the CLI and bad
input.

Pure arithmetic on schedules: no collective runs here, so the whole file takes a few seconds.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from tpu_scale import plan
from tpu_scale.distribute.mesh import ReplicaMesh
from tpu_scale.torus import schedule as torus

ALPHA = 2e-6
BANDWIDTH = 50e9


def _uniform(rows, cols, shared=False):
    return plan.uniform_cluster(ReplicaMesh.from_shape(rows, cols), ALPHA, BANDWIDTH, shared=shared)


# --------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("rows,cols", [(1, 2), (2, 4), (4, 4), (8, 4), (32, 32)])
def test_ring_steps_bytes_and_seconds_match_closed_form(rows, cols):
    n = rows * cols
    m = 2 * n * 1000  # divisible by every group size and by 2 streams
    price = plan.price_schedule(
        torus.build_schedule(ReplicaMesh.from_shape(rows, cols), m, "ring"), _uniform(rows, cols)
    )
    assert price["steps"] == 2 * (n - 1)
    assert price["bytes_per_node"] == pytest.approx(2 * (n - 1) / n * m)
    assert price["seconds"] == pytest.approx(2 * (n - 1) * ALPHA + 2 * (n - 1) / n * m / BANDWIDTH)


@pytest.mark.parametrize("algorithm", ["torus_2d", "torus_2d_bidirectional"])
@pytest.mark.parametrize("rows,cols", [(2, 4), (4, 4), (8, 4), (16, 8), (32, 32)])
def test_2d_steps_and_bytes_match_closed_form(algorithm, rows, cols):
    n = rows * cols
    m = 2 * n * 1000
    price = plan.price_schedule(
        torus.build_schedule(ReplicaMesh.from_shape(rows, cols), m, algorithm), _uniform(rows, cols)
    )
    assert price["steps"] == 2 * (rows - 1) + 2 * (cols - 1)
    assert price["bytes_per_node"] == pytest.approx(2 * (n - 1) / n * m)
    assert price["local_steps"] == 0


def test_torus_2d_seconds_match_closed_form():
    rows, cols, m = 4, 8, 64 * 1000
    price = plan.price_schedule(
        torus.build_schedule(ReplicaMesh.from_shape(rows, cols), m, "torus_2d"),
        _uniform(rows, cols),
    )
    steps = 2 * (rows - 1) + 2 * (cols - 1)
    assert price["seconds"] == pytest.approx(
        steps * ALPHA + 2 * (rows * cols - 1) / (rows * cols) * m / BANDWIDTH
    )


def test_paper_32x32_figure_124_vs_2046_steps():
    # One replica per chip, and the real v3-2048 slice (2 cores per chip combine on chip first).
    for hardware in (_uniform(32, 32), plan.tpu_slice("v3-2048")):
        prices = plan.price_algorithms(hardware, plan.gradient_bytes("resnet50")[1])
        assert prices["ring"]["steps"] == 2046
        assert prices["torus_2d"]["steps"] == 124
        assert prices["torus_2d_bidirectional"]["steps"] == 124
    v3 = plan.tpu_slice("v3-2048")
    assert v3.mesh.shape == (32, 64) and v3.num_nodes == 1024 and v3.num_hosts == 256


def test_tpu_slice_shapes_follow_the_notes():
    expected = {
        "v3-2048": (32, 32),
        "v3-1024": (32, 16),
        "v3-512": (16, 16),
        "v3-256": (16, 8),
        "v3-128": (8, 8),
        "v3-32": (4, 4),
        "v3-8": (2, 2),
    }
    for name, (x, y) in expected.items():
        hardware = plan.tpu_slice(name)
        assert hardware.node_shape == (x, y)
        assert hardware.mesh.shape == (y, 2 * x) and hardware.mesh.cores_per_chip == 2
        assert hardware.num_replicas == int(name.split("-")[1])


def test_gpu_ring_is_flat_and_2d_keeps_network_steps_low():
    hosts, gpus, m = 32, 8, 256 * 2 * 1000
    hardware = plan.gpu_cluster(hosts, gpus)
    prices = plan.price_algorithms(hardware, m)
    n = hosts * gpus
    assert prices["ring"]["steps"] == 2 * (hosts - 1)
    assert prices["ring"]["steps"] + prices["ring"]["local_steps"] == 2 * (n - 1)
    assert prices["ring"]["bytes_per_node"] == pytest.approx(2 * (n - 1) / n * m)
    assert prices["torus_2d"]["local_steps"] == 2 * (gpus - 1)
    assert prices["torus_2d"]["seconds"] < prices["ring"]["seconds"]


# --------------------------------------------------------------------------- orderings


@pytest.mark.parametrize("name", ["v3-8", "v3-512", "v3-2048", "v2-512", "v4-8192"])
def test_seconds_grow_with_bytes(name):
    hardware = plan.tpu_slice(name)
    sizes = [10**3, 10**5, 10**7, 10**8]
    for alg in torus.ALGORITHMS:
        secs = [plan.price_algorithms(hardware, b)[alg]["seconds"] for b in sizes]
        assert secs == sorted(secs) and secs[0] < secs[-1], (alg, secs)


@pytest.mark.parametrize("generation", ["v2", "v3", "v4"])
def test_cost_grows_with_chips(generation):
    num_bytes = plan.gradient_bytes("resnet50")[1]
    series = plan.scaling_series(generation, num_bytes)
    assert series["chips"] == sorted(series["chips"])
    for alg in torus.ALGORITHMS:
        assert series["steps"][alg] == sorted(series["steps"][alg]), alg
    assert series["seconds"]["ring"] == sorted(series["seconds"]["ring"])


@pytest.mark.parametrize("algorithm", torus.ALGORITHMS)
def test_2d_cost_grows_with_square_pods(algorithm):
    # Square shapes only: on an X x Y slice, growing X shrinks the shard the Y links carry, so a
    # wider but not taller slice can be slightly cheaper for the 2-D forms (v2-256, 16x8 chips, vs
    # v2-128, 8x8).
    num_bytes = plan.gradient_bytes("resnet50")[1]
    uniform = [
        plan.price_algorithms(_uniform(s, s), num_bytes)[algorithm]["seconds"]
        for s in (2, 4, 8, 16, 32)
    ]
    assert uniform == sorted(uniform)
    v3 = [
        plan.price_algorithms(plan.tpu_slice(n, wraparound="all"), num_bytes)[algorithm]["seconds"]
        for n in ("v3-8", "v3-32", "v3-128", "v3-512", "v3-2048")
    ]
    assert v3 == sorted(v3)


@pytest.mark.parametrize(
    "hardware",
    [
        plan.tpu_slice("v3-2048"),
        plan.tpu_slice("v4-8192"),
        plan.tpu_slice("v3-2048", wraparound="all"),
        _uniform(32, 32),
    ],
    ids=["v3-2048", "v4-8192", "v3-2048-torus", "uniform-32x32"],
)
def test_bidirectional_beats_2d_beats_ring_on_large_pods(hardware):
    prices = plan.price_algorithms(hardware, plan.gradient_bytes("resnet50")[1])
    seconds = {a: p["seconds"] for a, p in prices.items()}
    assert seconds["torus_2d_bidirectional"] <= seconds["torus_2d"] <= seconds["ring"], seconds


def test_concurrent_streams_share_links():
    m = 64 * 2 * 1000 * 1000
    own = plan.price_algorithms(_uniform(8, 8, shared=False), m)
    shared = plan.price_algorithms(_uniform(8, 8, shared=True), m)
    # Separate row and column links: the two halves run at once, so the transfer takes half as long.
    assert own["torus_2d_bidirectional"]["transfer_seconds"] == pytest.approx(
        own["torus_2d"]["transfer_seconds"] / 2, rel=0.01
    )
    # One shared resource (CPU replicas on one memory): nothing to gain from running both halves at
    # once.
    assert shared["torus_2d_bidirectional"]["seconds"] == pytest.approx(
        shared["torus_2d"]["seconds"], rel=0.02
    )


def test_multi_core_chips_combine_on_chip_in_row_phases():
    hardware = plan.tpu_slice("v3-2048")
    prices = plan.price_algorithms(hardware, 2048 * 2 * 100)
    m = 2048 * 2 * 100
    assert prices["torus_2d"]["local_steps"] == 2
    assert prices["torus_2d"]["bytes_per_node"] == pytest.approx(2 * 1023 / 1024 * m)
    # The columns-first half of the bidirectional form sends both cores' copies over the column
    # links.
    assert prices["torus_2d_bidirectional"]["bytes_per_node"] > prices["torus_2d"]["bytes_per_node"]


# --------------------------------------------------------------------------- input rate and BN
# groups


def test_input_rate_per_host_matches_paper():
    rate = plan.input_rate(plan.tpu_slice("v3-2048"))
    assert rate["per_host"] == pytest.approx(4100)
    assert rate["per_chip"] == pytest.approx(1025)
    target = plan.input_rate(plan.tpu_slice("v3-2048"), target_images_per_sec=1_050_000)
    assert target["per_host"] == pytest.approx(1_050_000 / 256)


@pytest.mark.parametrize(
    "per_core,group,span,chips",
    [
        (16, 4, 64, [1, 2]),
        (8, 8, 64, [2, 2]),
        (4, 16, 64, [2, 4]),
        (2, 32, 64, [4, 4]),
        (64, 1, 64, [1, 1]),
    ],
)
def test_bn_group_suggestion_uses_topology_tiles(per_core, group, span, chips):
    bn = plan.suggest_bn_group(plan.tpu_slice("v3-2048").mesh, per_core)
    assert (bn["group_size"], bn["span"], bn["tile_chips"]) == (group, span, chips)
    assert bn["in_range"]
    mesh = plan.tpu_slice("v3-2048").mesh
    assert bn["first_group"] == mesh.group_assignment(group, tiled=True)[0].tolist()


def test_bn_group_edge_cases():
    big = plan.suggest_bn_group(plan.tpu_slice("v3-2048").mesh, 200)
    assert big["group_size"] == 1 and not big["in_range"] and "alone" in big["note"]
    small = plan.suggest_bn_group(plan.tpu_slice("v3-8").mesh, 2)
    assert small["group_size"] == 8 and small["span"] == 16 and not small["in_range"]


# --------------------------------------------------------------------------- CLI, JSON, plot


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "tpu_scale.plan", *args], capture_output=True, text=True, timeout=60
    )


def test_cli_json_shape():
    out = _cli("--slice", "v3-2048", "--model", "resnet50", "--per_core_batch", "16", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result["algorithms"]) == set(torus.ALGORITHMS)
    for a in result["algorithms"].values():
        assert {"steps", "seconds", "bytes_per_node", "local_steps"} <= set(a)
    assert result["algorithms"]["torus_2d"]["steps"] == 124
    assert result["model"]["bytes"] == plan.MODELS["resnet50"] * 4
    assert result["bn_group"]["group_size"] == 4
    assert result["input"]["per_host"] == pytest.approx(4100)


# --------------------------------------------------------------------------- the weight update


@pytest.mark.parametrize(
    "name, per_core_batch, replicas, chips, per_replica_bandwidth, chip_rate",
    [
        ("v3-1024", 16, 1024, 512, 900e9 / 2, 1025.0),  # a v3 core: half its chip's HBM
        ("v3-1024", 32, 1024, 512, 900e9 / 2, 1025.0),
        ("v4-1024", 32, 512, 512, 1200e9, 1025 * 275 / 123),  # 512 chips, one replica each
    ],
)
def test_weight_update_figures_match_a_hand_calculation(
    name, per_core_batch, replicas, chips, per_replica_bandwidth, chip_rate
):
    out = _cli("--slice", name, "--per_core_batch", str(per_core_batch), "--json")
    assert out.returncode == 0, out.stderr
    w = json.loads(out.stdout)["weight_update"]
    params = 25_583_592  # ResNet-50; LARS reads w, g, m, w and g again, writes m and w: 7 x 4 B
    shard = -(-params // replicas)
    replicated = params * 28 / per_replica_bandwidth
    sharded = shard * 28 / per_replica_bandwidth
    step = per_core_batch * replicas / (chips * chip_rate)
    assert w["optimizer"] == "lars" and w["bytes_per_param"] == 28
    assert w["sharded_over"] == replicas and w["in_package"] is False  # XLA's sharding, on TPU
    assert w["replicated_seconds"] == pytest.approx(replicated)
    assert w["sharded_seconds"] == pytest.approx(sharded)
    assert w["state_bytes_per_replica"] == {"replicated": params * 4, "sharded": shard * 4}
    assert w["share_of_step"]["replicated"] == pytest.approx(replicated / step)
    assert w["step_speedup"] == pytest.approx(step / (step - replicated + sharded))


def test_weight_update_of_a_model_whose_state_matters():
    hardware = plan.tpu_slice("v3-1024")
    w = plan.plan(hardware, "vit_b16", optimizer="adamw", per_core_batch=4)["weight_update"]
    params = plan.MODELS["vit_b16"]
    assert w["replicated_seconds"] == pytest.approx(params * 36 / 450e9)
    assert w["state_bytes_per_replica"]["replicated"] == params * 8  # two float32 moments
    assert w["state_bytes_per_replica"]["sharded"] == -(-params // 1024) * 8
    # Its step time is not ResNet-50's: no share without a target rate for this model.
    assert w["share_of_step"] is None and w["step_speedup"] is None
    given = plan.plan(
        hardware, "vit_b16", optimizer="adamw", per_core_batch=4, target_images_per_sec=1e5
    )["weight_update"]
    assert given["share_of_step"]["replicated"] == pytest.approx(
        w["replicated_seconds"] / (4 * 1024 / 1e5)
    )
    text = plan.format_plan(plan.plan(hardware, "vit_b16", optimizer="adamw"))
    assert "weight update (adamw)" in text and "692.5 MB -> 676.3 kB" in text
    with pytest.raises(ValueError, match="Unknown optimizer 'rmsprop'"):
        plan.plan(hardware, "vit_b16", optimizer="rmsprop")
    assert plan.plan(_uniform(2, 4), params=1000)["weight_update"] is None  # no memory figure


def test_weight_update_on_gpu_hosts_is_sharded_over_every_replica():
    # As the package shards under MultiWorkerMirroredStrategy: over the replicas of every host.
    hardware = plan.gpu_cluster(4, 8)
    w = plan.plan(hardware, "resnet50", per_core_batch=32)["weight_update"]
    params = plan.MODELS["resnet50"]
    assert w["sharded_over"] == 32 and w["in_package"] is True
    assert w["state_bytes_per_replica"] == {
        "replicated": params * 4,
        "sharded": -(-params // 32) * 4,
    }
    assert w["sharded_seconds"] == pytest.approx(
        w["replicated_seconds"] * -(-params // 32) / params
    )
    text = plan.format_plan(plan.plan(hardware, "resnet50", per_core_batch=32))
    assert "sharded over all 32 replicas across the hosts" in text
    tpu_text = plan.format_plan(plan.plan(plan.tpu_slice("v3-8"), "resnet50"))
    assert "create_strategy does not shard the update on a TPU yet" in tpu_text


def test_sharding_advice_prices_the_users_model_on_the_strategys_hardware():
    import types

    class SGD:  # the optimizer's class name is what the planner prices
        pass

    class RMSprop:
        pass

    def strategy(**hardware):
        # What create_strategy attaches: the hardware it found, and the mesh.
        if not hardware:
            return types.SimpleNamespace()
        priced = plan.hardware_cluster(**hardware)
        return types.SimpleNamespace(
            auto_algorithm=types.SimpleNamespace(hardware=hardware), mesh=priced.mesh
        )

    def model(optimizer):
        weights = [np.zeros((1000, 100)), np.zeros((100,))]
        return types.SimpleNamespace(optimizer=optimizer(), trainable_variables=weights)

    gpus = plan.gpu_cluster(2, 8)
    w = plan.weight_update(gpus, 100_100, "sgd")
    two_hosts = strategy(kind="gpu", hosts=2, replicas_per_host=8)
    advice = plan.sharding_advice(two_hosts, model(SGD))
    assert advice.startswith("tpu_scale.plan: weight_update_sharding=True would cut the sgd update")
    assert "400.4 kB to 25.0 kB" in advice  # 100,100 float32 momenta, over 2 hosts' 16 GPUs
    assert f"{w['replicated_seconds'] * 1e6:.1f} us" in advice
    assert plan.sharding_advice(strategy(kind="tpu", tpu_slice_name="v3-8"), model(SGD)) == ""
    assert plan.sharding_advice(strategy(kind="gpu", replicas_per_host=1), model(SGD)) == ""
    eight_hosts = strategy(kind="gpu", hosts=8, replicas_per_host=1)
    assert "to 50.1 kB" in plan.sharding_advice(eight_hosts, model(SGD))
    assert plan.sharding_advice(strategy(), model(SGD)) == ""
    assert plan.sharding_advice(two_hosts, model(RMSprop)) == ""
    # A wrapped optimizer is priced as the one it holds, and the advice names the wrapper.
    wrapped = types.SimpleNamespace(inner_optimizer=SGD())
    assert plan.sharding_advice(two_hosts, model(lambda: wrapped)) == advice
    assert advice.endswith("(tpu_scale.DistributedOptimizer(optimizer, weight_update_sharding=True))")


def test_cli_table_and_gpu(capsys):
    assert (
        plan.main(
            ["--hosts", "4", "--gpus_per_host", "8", "--params", "1000000", "--dtype", "bfloat16"]
        )
        == 0
    )
    text = capsys.readouterr().out
    for name in torus.ALGORITHMS:
        assert name in text
    assert "bytes/host" in text and "2.0 MB per replica" in text


def test_plot_file_written(tmp_path):
    path = tmp_path / "scaling.png"
    assert plan.main(["--slice", "v3-512", "--plot", str(path), "--json"]) == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "name,message",
    [
        ("v3-3", "valid: ['v3-8'"),
        ("v9-8", "known generations"),
        ("v3", "expected '<generation>-<cores>'"),
        ("v3-abc", "valid"),
        ("", "expected"),
    ],
)
def test_bad_slice_names(name, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        plan.tpu_slice(name)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"params": -3}, "positive integer"),
        ({"params": 0}, "positive integer"),
        ({"model": "resnet49"}, "known models"),
        ({"model": "resnet50", "params": 10}, "exactly one"),
        ({"model": "resnet50", "dtype": "int8"}, "float32"),
    ],
)
def test_bad_gradient_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan.gradient_bytes(**kwargs)


def test_bad_hardware_and_sizes():
    with pytest.raises(ValueError, match="hosts must be a positive integer"):
        plan.gpu_cluster(0, 8)
    with pytest.raises(ValueError, match="gpus_per_host"):
        plan.gpu_cluster(4, -1)
    with pytest.raises(ValueError, match="Unknown GPU type"):
        plan.gpu_cluster(4, 8, gpu="k80")
    with pytest.raises(ValueError, match="num_bytes must be a non-negative"):
        plan.price_algorithms(plan.tpu_slice("v3-8"), -1)
    with pytest.raises(ValueError, match="per_core_batch"):
        plan.suggest_bn_group(plan.tpu_slice("v3-8").mesh, 0)
    with pytest.raises(ValueError, match="wraparound"):
        plan.tpu_slice("v3-8", wraparound="sometimes")
    with pytest.raises(ValueError, match="build the schedule on hardware.mesh"):
        plan.price_schedule(
            torus.build_schedule(ReplicaMesh.from_shape(2, 2), 64, "ring"), plan.tpu_slice("v3-8")
        )
    with pytest.raises(ValueError, match="target_images_per_sec"):
        plan.input_rate(plan.tpu_slice("v3-8"), -5.0)


def test_cli_bad_input_exits_with_clear_message():
    out = _cli("--slice", "v3-3")
    assert out.returncode == 2 and "v3-2048" in out.stderr and "Traceback" not in out.stderr
    out = _cli("--hosts", "4")
    assert out.returncode == 2 and "--gpus_per_host" in out.stderr


def test_pack_sizes_follow_the_executor_rule():
    assert plan.pack_sizes([10, 10, 10], pack_bytes=25) == [20, 10]
    assert plan.pack_sizes([40, 5], pack_bytes=25) == [40, 5]
    assert plan.pack_sizes([10, 10], pack_bytes=None) == [20]
    assert np.sum(plan.pack_sizes([4] * 100, 64)) == 400


# --------------------------------------------------------------------------- the "auto" decision

RESNET50 = [(4 * 25_583_592 // 214, "float32")] * 214


@pytest.mark.parametrize(
    "hardware,expected",
    [
        (dict(kind="cpu", replicas_per_host=8), "flat"),
        (dict(kind="cpu", replicas_per_host=8, mesh_shape=(2, 4)), "flat"),
        (dict(kind="cpu", hosts=2, replicas_per_host=4), "torus_2d"),
        (dict(kind="gpu", hosts=32, replicas_per_host=8, gpu="a100"), "native"),
        (dict(kind="tpu", tpu_slice_name="v3-2048"), "torus_2d_bidirectional"),
        (dict(kind="tpu", tpu_slice_name="v4-512"), "torus_2d_bidirectional"),
    ],
)
def test_auto_decision_on_described_hardware(hardware, expected):
    choice = plan.choose_algorithm(plan.hardware_cluster(**hardware), RESNET50)
    assert choice.algorithm == expected, choice.summary()
    priced = {a: s for a, s in choice.predicted.items() if s is not None}
    assert set(choice.predicted) == set(torus.ALGORITHMS_AND_NATIVE)
    assert priced[expected] == min(priced.values())


def test_auto_decision_follows_the_wraparound_assumption():
    # A sub-pod v3 slice: lines, so a 1-D form; every dimension wrapped: the 2-D forms.
    lines = plan.choose_algorithm(plan.tpu_slice("v3-32"), RESNET50)
    assert lines.algorithm in ("ring", "flat"), lines.summary()
    wrapped = plan.choose_algorithm(plan.tpu_slice("v3-32", wraparound="all"), RESNET50)
    assert wrapped.algorithm.startswith("torus_2d"), wrapped.summary()
    assert lines.predicted["native"] is None  # XLA's own reduction is not priced


def test_auto_decision_small_gradients_across_gpu_hosts_take_the_torus():
    small = [(4000, "float32")] * 20
    assert plan.choose_algorithm(plan.gpu_cluster(32, 8), small).algorithm == "torus_2d"


def test_bfloat16_transport_halves_only_phases_between_hosts():
    hardware = plan.hardware_cluster("cpu", hosts=2, replicas_per_host=4)
    f32 = plan.price_option(hardware, RESNET50, "torus_2d")
    bf16 = plan.price_option(hardware, RESNET50, "torus_2d", gradient_dtype="bfloat16")
    assert bf16 < f32
    # One host: no phase between hosts, nothing changes.
    one = plan.hardware_cluster("cpu", replicas_per_host=8)
    assert plan.price_option(
        one, RESNET50, "flat", gradient_dtype="bfloat16"
    ) == plan.price_option(one, RESNET50, "flat")
    mesh = ReplicaMesh.for_workers(2, 4)
    schedule = torus.build_schedule(mesh, 8 * 1000, "torus_2d")
    moved = torus.transport_schedule(schedule, lambda r: r // 4, 4, 2)
    assert [p.bytes_in for p in moved.streams[0]] == [8000, 1000, 2000]
    assert [p.bytes_in for p in schedule.streams[0]] == [8000, 2000, 2000]


def test_flat_schedule_is_one_all_reduce_and_pads_nothing():
    mesh = ReplicaMesh.from_shape(2, 4)
    schedule = torus.build_schedule(mesh, 100, "flat")
    [[phase]] = schedule.streams
    assert (phase.kind, phase.group_size, phase.bytes_in) == (torus.ALL_REDUCE, 8, 100)
    assert torus.padded_length(7, mesh, "flat") == 7
    assert torus.phase_within_hosts(phase, lambda r: 0)
    assert not torus.phase_within_hosts(phase, lambda r: r // 4)


def test_choose_algorithm_needs_tensors():
    with pytest.raises(ValueError, match="at least one gradient tensor"):
        plan.choose_algorithm(plan.hardware_cluster("cpu", replicas_per_host=8), [])


def test_calibrate_stays_the_function_after_its_module_is_imported():
    first = plan.calibrate
    import tpu_scale.plan.calibration  # noqa: F401  (what the command line imports)

    assert plan.calibrate is first and callable(plan.calibrate)
