"""Gradient summation: the torus schedule against TensorFlow's all-reduces, on ResNet-50's
gradients.

(a) One host, 8 virtual CPU replicas, one process: the time to sum ResNet-50's trainable gradients
    (the shapes of `keras.applications.ResNet50(weights=None)`: 214 float32 tensors, 25.6 M values,
    102 MB per replica) with `tpu_scale.torus.all_reduce.all_reduce_sum` on a 2x4 mesh (each algorithm) against
    TensorFlow's default (`ReplicaContext.all_reduce` under a plain `MirroredStrategy`, which uses
    `CollectiveAllReduce`, a ring) and `ReductionToOneDevice`; and `ReplicaContext.all_reduce`
    under the package's strategy (`seam_*`), which `tpu_scale.TorusAllReduce` runs: the path every
    program under `create_strategy()` takes (`fit`, `apply_gradients`, a custom loop).
(b) Two localhost worker processes x 4 replicas over gRPC (`MultiWorkerMirroredStrategy`, mesh 2x4
    with one row per worker): the hierarchical torus (`torus_2d`, what `"auto"` picks across
    hosts), in replica context and through the strategy's `TorusAllReduce` (`seam_auto`), against
    the default multi-worker all-reduce of the same strategy (its `TorusAllReduce` handing every
    value to TensorFlow's collective ops); with the bytes each one sends across the process boundary, computed from the schedule
    (`torus.bytes_sent_between`) and, for TensorFlow's single ring over 8 replicas in task order,
    from the ring algorithm (`torus.ring_bytes_sent_between`: 2 of the 8 ring edges cross, each
    carrying 2 (n-1)/n of the buffer).

Every benchmark runs TensorFlow's BFC CPU allocator, as the example does (`common.py`); the JSON
records it.

Every method runs the same `tf.function`-wrapped `strategy.run`, in interleaved rounds after a
warm-up so that load from other users of the machine hits every method alike; figures are medians of
the rounds, with min-max.

Over loopback the two processes of (b) share two cores and one memory, so bytes between them cost
little more than bytes inside one, and sending fewer of them gains little. `--link_gbit R` runs (b)
as two "hosts" instead: each worker in a network namespace of its own, the two joined by a veth pair
shaped with `tc` to R Gbit/s each way (`emulated_link.py`; needs root). The JSON then records the
link (rate, tc commands, a socket throughput check across it, the bytes its queues passed) and, per
method, the time its crossing bytes need at that rate. Such figures are an "emulated R Gbit/s link
(tc)", not a real network: the cores and memory are still shared and no delay is added.

Usage:
    python benchmarks/all_reduce.py [--quick] [--rounds N]
    python benchmarks/all_reduce.py --part two_processes --link_gbit 1 [--rounds N]   # as root

Writes `benchmarks/results/all_reduce.json`, or `all_reduce_link<R>gbit.json` with `--link_gbit`
(`--output` to choose).
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import HERE, RESULTS, machine_info, run_child, timed_rounds, write_child_output  # noqa: E402

NUM_REPLICAS = 8


# --------------------------------------------------------------------------- shared


def _per_replica_gradients(strategy, shapes):
    import tensorflow as tf

    def make(ctx):
        seed = ctx.replica_id_in_sync_group
        return [tf.random.stateless_uniform(s, seed=[seed, i]) for i, s in enumerate(shapes)]

    return strategy.experimental_distribute_values_from_function(make)


def _summer(strategy, reduce_fn):
    import tensorflow as tf

    @tf.function
    def step(grads):
        return strategy.run(reduce_fn, args=(grads,))

    return step


def _native(grads):
    """The replica context's own sum: what `fit`, `apply_gradients` and a custom loop ask for; under
    a strategy of the package, `tpu_scale.TorusAllReduce` runs it."""
    import tensorflow as tf

    return tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, grads)


def _traced_with(strategy, fn, grads, algorithm, gradient_dtype=None):
    """`_summer(strategy, fn)`, traced while the strategy's `TorusAllReduce` runs `algorithm`
    (`"native"`: TensorFlow's own collective ops); the trace keeps that choice."""
    ops = strategy.cross_device_ops
    saved = ops.algorithm, ops.gradient_dtype
    ops.algorithm, ops.gradient_dtype = algorithm, gradient_dtype
    try:
        step = _summer(strategy, fn)
        step.get_concrete_function(grads)
    finally:
        ops.algorithm, ops.gradient_dtype = saved
    return step


def _torus(algorithm, pack_bytes=None, gradient_dtype=None):
    from tpu_scale.torus import all_reduce as torus
    def reduce_fn(grads):
        kwargs = {} if pack_bytes is None else {"pack_bytes": pack_bytes}
        return torus.all_reduce_sum(
            grads, algorithm=algorithm, gradient_dtype=gradient_dtype, **kwargs
        )

    return reduce_fn


def _auto_choice(strategy, shapes, gradient_dtype=None):
    """What "auto" picks for these gradients on `strategy` (the run-time rule), and the planner's
    predictions for the same hardware."""
    import numpy as np

    from tpu_scale.plan import choose_algorithm
    from tpu_scale.plan.report import strategy_hardware

    tensors = [(int(np.prod(s)) * 4, "float32") for s in shapes]
    choice = choose_algorithm(strategy_hardware(strategy), tensors, gradient_dtype=gradient_dtype)
    return {
        "algorithm": strategy.auto_algorithm(strategy.mesh, tensors),
        "planner_algorithm": choice.algorithm,
        "hardware": choice.hardware,
        "predicted_s": {
            a: (None if v is None else round(v, 4)) for a, v in choice.predicted.items()
        },
    }


def _timed_rounds(methods, rounds, warmup):
    """`{name: [seconds per round]}`; methods run in turn every round so load hits them alike."""
    import tensorflow as tf

    def blocking(step, args):
        def call():
            # Wait for every replica's result: the last op of every device.
            for value in tf.nest.flatten(step(*args), expand_composites=True)[-NUM_REPLICAS:]:
                value.numpy()

        return call

    return timed_rounds({name: blocking(*m) for name, m in methods.items()}, rounds, warmup)


def _summary(times, baseline):
    median = {name: statistics.median(t) for name, t in times.items()}
    return {
        name: {
            "median_s": round(median[name], 4),
            "min_s": round(min(t), 4),
            "max_s": round(max(t), 4),
            "rounds": len(t),
            f"ratio_to_{baseline}": round(median[name] / median[baseline], 3),
        }
        for name, t in times.items()
    }


def _with_ratio(summary, name, baseline, times):
    """Adds the median of per-round ratios `name / baseline` (same round, same load)."""
    per_round = [a / b for a, b in zip(times[name], times[baseline])]
    summary[name][f"per_round_ratio_to_{baseline}"] = {
        "median": round(statistics.median(per_round), 3),
        "min": round(min(per_round), 3),
        "max": round(max(per_round), 3),
    }
    return summary


def _check_equal(step_a, step_b, grads, strategy, rtol=1e-5):
    """The methods must agree before their times mean anything."""
    import numpy as np

    a = strategy.experimental_local_results(step_a(grads)[0])[0].numpy()
    b = strategy.experimental_local_results(step_b(grads)[0])[0].numpy()
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())


# --------------------------------------------------------------------------- (a) one host


def single_host(rounds, warmup):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_REPLICAS
    )
    import tpu_scale
    from tpu_scale.plan.calibration import model_gradient_shapes

    shapes = [tuple(s) for s in model_gradient_shapes("resnet50")]
    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:NUM_REPLICAS]
    ours = tpu_scale.create_strategy(num_cpu_replicas=NUM_REPLICAS, mesh_shape=(2, 4))
    ours_2d = tpu_scale.create_strategy(
        num_cpu_replicas=NUM_REPLICAS, mesh_shape=(2, 4), gradient_algorithm="torus_2d"
    )
    default = tf.distribute.MirroredStrategy(devices)
    to_one = tf.distribute.MirroredStrategy(
        devices, cross_device_ops=tf.distribute.ReductionToOneDevice()
    )
    default_kind = type(default.extended._cross_device_ops).__name__  # TensorFlow's own choice

    methods = {}
    for name, strategy, fn in [
        ("tf_default_collective", default, _native),
        ("tf_reduction_to_one_device", to_one, _native),
        ("torus_auto", ours, _torus("auto")),  # the planner's choice for this machine
        # The strategy's own sum through its cross-device ops (TorusAllReduce), as every program
        # under it gets it: "auto", and the 2-D torus.
        ("seam_auto", ours, _native),
        ("seam_torus_2d", ours_2d, _native),
        ("torus_ring", ours, _torus("ring")),
        ("torus_2d", ours, _torus("torus_2d")),
        ("torus_2d_bidirectional", ours, _torus("torus_2d_bidirectional")),
    ]:
        methods[name] = (_summer(strategy, fn), (_per_replica_gradients(strategy, shapes),))
    for name in methods:
        if name.startswith(("torus", "seam")):
            step, args = methods[name]
            _check_equal(step, methods["tf_default_collective"][0], args[0], ours)
    times = _timed_rounds(methods, rounds, warmup)
    num_values = sum(int(__import__("numpy").prod(s)) for s in shapes)
    return {
        "replicas": NUM_REPLICAS,
        "mesh": [2, 4],
        "tensors": len(shapes),
        "values": num_values,
        "bytes_per_replica": 4 * num_values,
        "tf_default_cross_device_ops": default_kind,
        "auto": _auto_choice(ours, shapes),
        "methods": _with_ratio(
            _with_ratio(
                _summary(times, "tf_default_collective"),
                "torus_auto",
                "tf_reduction_to_one_device",
                times,
            ),
            "seam_auto",
            "tf_reduction_to_one_device",
            times,
        ),
        "shapes": shapes,
    }


# --------------------------------------------------------------------------- (b) two processes


def worker(rounds, warmup, shapes):
    """Runs in each worker process (`tpu_scale.testing.run_workers`, or
    `emulated_link.EmulatedLink.run_workers` with `--link_gbit`)."""
    import tensorflow as tf

    import tpu_scale

    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"])
    )
    grads = _per_replica_gradients(strategy, [tuple(s) for s in shapes])
    methods = {
        # TensorFlow's own multi-worker collective ops: the strategy's sum with the package's
        # cross-device ops handing every value to them.
        "tf_default_multi_worker": (_traced_with(strategy, _native, grads, "native"), (grads,)),
        "torus_auto": (_summer(strategy, _torus("auto")), (grads,)),
        # The strategy's own sum through TorusAllReduce, as every program under it gets it.
        "seam_auto": (_traced_with(strategy, _native, grads, "auto"), (grads,)),
        "torus_2d_hierarchical": (_summer(strategy, _torus("torus_2d")), (grads,)),
        "torus_2d_bfloat16_between_hosts": (
            _summer(strategy, _torus("torus_2d", gradient_dtype="bfloat16")),
            (grads,),
        ),
        "torus_flat": (_summer(strategy, _torus("flat")), (grads,)),
    }
    for name in ("torus_auto", "seam_auto", "torus_2d_hierarchical", "torus_flat"):
        _check_equal(methods[name][0], methods["tf_default_multi_worker"][0], grads, strategy)
    _check_equal(
        methods["torus_2d_bfloat16_between_hosts"][0],
        methods["tf_default_multi_worker"][0],
        grads,
        strategy,
        rtol=2e-2,
    )
    times = _timed_rounds(methods, rounds, warmup)
    return {
        "mesh": list(strategy.mesh.shape),
        "times": times,
        "auto": _auto_choice(strategy, shapes),
        "auto_bfloat16": _auto_choice(strategy, shapes, "bfloat16"),
        "cross_device_ops": repr(strategy.cross_device_ops),
        "tf": tf.__version__,
    }


def two_processes(rounds, warmup, shapes, link=None):
    """Part (b); over loopback, or over `link` (an `emulated_link.EmulatedLink`) when given."""
    import numpy as np

    from tpu_scale.distribute.mesh import ReplicaMesh
    from tpu_scale.testing import run_workers
    from tpu_scale.torus import all_reduce as torus

    kwargs = {"rounds": rounds, "warmup": warmup, "shapes": [list(s) for s in shapes]}
    if link is None:
        results = run_workers(
            "all_reduce:worker", num_workers=2, cpus_per_worker=4, kwargs=kwargs, timeout=1800
        )
    else:
        # The link's real rate, measured just before the workers use it.
        link_check = link.measure()
        print(f"{link.settings['label']}: measured {link_check}", file=sys.stderr)
        results = link.run_workers(
            "all_reduce:worker", kwargs=kwargs, cpus_per_worker=4, timeout=1800
        )
    # A round ends when the slower worker ends: take the max over workers.
    names = results[0]["times"].keys()
    times = {n: [max(r["times"][n][i] for r in results) for i in range(rounds)] for n in names}
    summary = _summary(times, "tf_default_multi_worker")
    num_bytes = 4 * sum(int(np.prod(s)) for s in shapes)
    mesh = ReplicaMesh.for_workers(2, 4)
    host = lambda replica: replica // 4  # noqa: E731

    def crossing_of(algorithm, itemsize=4):
        schedule = torus.build_schedule(mesh, num_bytes, algorithm)
        schedule = torus.transport_schedule(schedule, host, 4, itemsize)
        return torus.bytes_sent_between(schedule, host)

    auto = results[0]["auto"]["algorithm"]
    crossing = {
        "tf_default_multi_worker": torus.ring_bytes_sent_between(8, num_bytes, host),
        "torus_auto": crossing_of(auto)
        if auto != "native"
        else torus.ring_bytes_sent_between(8, num_bytes, host),
        "seam_auto": crossing_of(auto)
        if auto != "native"
        else torus.ring_bytes_sent_between(8, num_bytes, host),
        "torus_2d_hierarchical": crossing_of("torus_2d"),
        "torus_2d_bfloat16_between_hosts": crossing_of("torus_2d", 2),
        "torus_flat": crossing_of("flat"),
    }
    for name in summary:
        summary[name]["bytes_between_processes"] = crossing[name]
        summary[name]["bytes_between_processes_per_gradient_byte"] = round(
            crossing[name] / num_bytes, 3
        )
    for name in (
        "torus_auto", "seam_auto", "torus_2d_hierarchical", "torus_2d_bfloat16_between_hosts"
    ):
        _with_ratio(summary, name, "tf_default_multi_worker", times)
    result = {
        "workers": 2,
        "replicas_per_worker": 4,
        "mesh": results[0]["mesh"],
        "tf_cross_device_ops": results[0]["cross_device_ops"],
        "auto": results[0]["auto"],
        "auto_bfloat16": results[0]["auto_bfloat16"],
        "methods": summary,
    }
    if link is not None:
        # Both hosts send the same amount (every schedule here is symmetric between the two), so
        # each direction of the full-duplex link carries half the crossing bytes: at the link's
        # rate that takes `link_bound_s`, a floor under the method's time; `link_share` near 1
        # means the method is bound by the link.
        for name in summary:
            bound = crossing[name] / 2 / (link.gbit * 1e9 / 8)
            summary[name]["link_bound_s"] = round(bound, 4)
            summary[name]["link_share"] = round(bound / summary[name]["median_s"], 3)
        result["link"] = dict(
            link.settings,
            check=link_check,
            # Everything the two tbf queues passed during the run (warm-ups, checks and rounds of
            # every method), packet headers included.
            qdisc_counters=link.qdisc_counters(),
        )
    return result


# --------------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (about 3 minutes)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--part",
        choices=["all", "single_host", "two_processes"],
        default="all",
        help="run only part (a) or (b) of the docstring",
    )
    parser.add_argument(
        "--skip_multi_worker", action="store_true", help="the same as --part single_host"
    )
    parser.add_argument(
        "--link_gbit",
        type=float,
        default=None,
        help="run the two processes as two hosts joined by an emulated link of this many Gbit/s "
        "each way (network namespaces + veth + tc; needs root); default: loopback",
    )
    parser.add_argument(
        "--output",
        default=None,
        help="result JSON (default: benchmarks/results/all_reduce.json, or "
        "all_reduce_link<R>gbit.json with --link_gbit)",
    )
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 9)
    warmup = 1 if args.quick else 2
    part = "single_host" if args.skip_multi_worker else args.part
    if args.link_gbit is not None:
        from emulated_link import unavailable_reason

        if part == "single_host":
            parser.error("--link_gbit applies to the two-process part only.")
        if not args.link_gbit > 0:
            parser.error(f"--link_gbit must be positive, got {args.link_gbit}.")
        reason = unavailable_reason()
        if reason:
            parser.error(f"--link_gbit: {reason}")
        output = os.path.join(RESULTS, f"all_reduce_link{args.link_gbit:g}gbit.json")
    else:
        output = os.path.join(RESULTS, "all_reduce.json")
    output = args.output or output

    with contextlib.ExitStack() as cleanup:
        link = None
        if args.link_gbit is not None:
            from emulated_link import EmulatedLink

            # Set up first, so a machine that cannot do it fails at the start, and deleted on
            # leaving whatever happens: success, an error, Ctrl-C or SIGTERM.
            link = cleanup.enter_context(EmulatedLink(args.link_gbit))
        result = _run(args, part, rounds, warmup, link)
    import tensorflow as tf

    result["tensorflow"] = tf.__version__
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


def _run(args, part, rounds, warmup, link):
    started = time.time()
    result = {
        "command": " ".join(["python", "benchmarks/all_reduce.py", *sys.argv[1:]]),
        "machine": machine_info(),
    }
    if part in ("all", "single_host"):
        # The single-host part runs in a child process: the workers' parent must not hold 8
        # logical CPUs' worth of buffers while they run, and each part then starts TensorFlow
        # fresh.
        result["single_host"] = _run_child("single", rounds, warmup)
        shapes = _shapes_from(result["single_host"])
    else:
        shapes = _run_child("shapes", rounds, warmup)  # the same, without timing part (a)
    if part in ("all", "two_processes"):
        sys.path.insert(0, HERE)
        result["two_processes"] = two_processes(rounds, warmup, shapes, link)
    result["seconds"] = round(time.time() - started, 1)
    return result


def _shapes_from(single):
    return single.pop("shapes")


def _run_child(part, rounds, warmup):
    return run_child(
        os.path.abspath(__file__), ["--_part", part, str(rounds), str(warmup)], timeout=1800
    )


if __name__ == "__main__":
    if "--_child_output" in sys.argv:
        _, _, out, _, part, rounds, warmup = sys.argv
        if part == "single":
            write_child_output(out, single_host(int(rounds), int(warmup)))
        else:
            assert part == "shapes"
            from tpu_scale.plan.calibration import model_gradient_shapes

            write_child_output(out, model_gradient_shapes("resnet50"))
    else:
        main()
