"""Calibration: fits the CPU cost figures on this machine's 8 CPU replicas (TensorFlow).

The only part of the planner that starts TensorFlow; `python -m tpu_scale.plan --calibrate` runs it.
"""

import math
import os
import time

import numpy as np

from tpu_scale.plan.catalog import MODELS
from tpu_scale.plan.report import format_bytes, format_seconds
from tpu_scale.torus import schedule as torus_schedule


def _median_time(fn, repeats):
    fn()  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(min(times)), float(max(times))


def _model_terms(n, mesh_shape, tensors, option, **figures):
    """The cost model's price of `option` for `tensors` under the given unit figures."""
    from tpu_scale.plan.catalog import cpu_cluster
    from tpu_scale.plan.choice import price_option

    return price_option(cpu_cluster(1, n, figures, mesh_shape), tensors, option)


def calibrate(sizes=(2**12, 2**18, 2**21, 2**23), repeats=5, model="resnet50", log=print):
    """Fits the CPU cost figures on this machine's 8 CPU replicas and checks them against real
    summations.

    In-graph sums (every option but TensorFlow's own on one host): times `torus.all_reduce_sum` with
    each in-graph algorithm on one tensor of each of `sizes[1:]`, on 16 tensors of `sizes[0]` and on
    48 tensors of sizes spread in log scale from `sizes[0]` to `sizes[-2]`, and fits `T = call +
    handoffs * handoff_seconds + traffic / memory_bandwidth`, with the hand-offs and the traffic
    counted by the cost model itself (`cost.in_graph_load`). TensorFlow's all-reduce (`"native"`,
    one collective op per tensor): times it on the same lists and on one tensor of `sizes[0]`, and
    fits `T = call + collectives * launch + ring_bytes / bandwidth`. Both by non-negative least
    squares of the relative error. Then sums the model's real gradient shapes, which no fit point
    has (ResNet-50: 214 tensors from 4 KiB to 9 MiB), with every option `"auto"` can pick
    (`torus_schedule.ALGORITHMS_AND_NATIVE`) and reports predicted over measured time (ratio < 1: the model is
    optimistic).

    Must run before TensorFlow starts anything else in the process (it creates the 8 logical CPUs).

    Returns:
      dict with the fitted figures (`cpu_figures`, the keys of `catalog.CPU_FIGURES`), the fit
      points and, per option, predicted and measured seconds and their ratio.
    """
    import tensorflow as tf

    from tpu_scale.distribute.strategy import create_strategy
    from tpu_scale.torus import all_reduce as torus

    strategy = create_strategy(num_cpu_replicas=8, mesh_shape=(2, 4), gradient_reduction="native")
    mesh = strategy.mesh
    n = mesh.num_replicas

    def timed(option, shapes):
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: [
                tf.fill(s, tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)) for s in shapes
            ]
        )

        @tf.function
        def run(v):
            # Every output is returned: plain ops whose results nothing reads would be pruned.
            return strategy.run(lambda x: torus.all_reduce_sum(x, algorithm=option), args=(v,))

        return _median_time(lambda: run(values), repeats)

    def fit_point(option, tensor_bytes, columns):
        med, lo, hi = timed(option, [[b // 4] for b in tensor_bytes])
        tensors = [(b, "float32") for b in tensor_bytes]
        terms = [_model_terms(n, mesh.shape, tensors, option, **figures) for figures in columns]
        log(
            f"  fit point: {option}, {len(tensor_bytes)} tensor(s) of "
            f"{format_bytes(min(tensor_bytes))}-{format_bytes(max(tensor_bytes))}: "
            f"{format_seconds(med)} (min {format_seconds(lo)}, max {format_seconds(hi)})"
        )
        return {
            "option": option,
            "tensors": len(tensor_bytes),
            "bytes": tensor_bytes[0],
            "terms": terms,
            "seconds": med,
            "min": lo,
            "max": hi,
        }

    def fit(points):
        a = np.array([[1.0] + p["terms"] for p in points])
        t = np.array([p["seconds"] for p in points])
        # Relative errors: the points span three orders of magnitude.
        coef = _nonnegative_lstsq(a / t[:, None], np.ones_like(t))
        return coef, float(np.sqrt(np.mean(((a @ coef - t) / t) ** 2)))

    # Gradient-like lists as well: tensors of sizes spread evenly in log scale, 48 up to
    # `sizes[-2]` and 96 up to `sizes[-1]` / 2 (tens of MB: large buffers page-fault, which small
    # points do not show).
    spread = [
        [int(b) // 4 * 4 for b in np.geomspace(sizes[0], top, count)]
        for count, top in ((48, sizes[-2]), (96, sizes[-1] // 2))
    ]
    lists = [[sizes[0]] * 16] + [[size] for size in sizes[1:]] + spread
    # Unit figures that make the model's price one term: hand-offs, then bytes of memory traffic.
    local_columns = (
        {"handoff_seconds": 1.0, "memory_bandwidth": 1e30},
        {"handoff_seconds": 0.0, "memory_bandwidth": 1.0},
    )
    local = [fit_point(o, b, local_columns) for o in torus_schedule.ALGORITHMS for b in lists]
    (local_call, handoff, inverse_memory), local_rms = fit(local)
    # ... collective launches, then ring bytes.
    native_columns = (
        {"collective_launch_seconds": 1.0, "collective_alpha": 0.0, "collective_bandwidth": 1e30},
        {"collective_launch_seconds": 0.0, "collective_alpha": 0.0, "collective_bandwidth": 1.0},
    )
    native = [fit_point("native", b, native_columns) for b in [[sizes[0]]] + lists]
    (call, launch, beta), rms = fit(native)
    bandwidth = 1.0 / beta if beta > 0 else math.inf
    memory_bandwidth = 1.0 / inverse_memory if inverse_memory > 0 else math.inf
    figures = {
        "call_seconds": float(call),
        "collective_launch_seconds": float(launch),
        "collective_alpha": 0.0,
        "collective_bandwidth": bandwidth,
        "handoff_seconds": float(handoff),
        "memory_bandwidth": memory_bandwidth,
    }
    fit_summary = {
        "call_seconds": float(call),
        "launch_seconds": float(launch),
        "bandwidth_bytes_per_sec": bandwidth,
        "rms_relative_error": rms,
        "in_graph_call_seconds": float(local_call),
        "in_graph_handoff_seconds": float(handoff),
        "memory_bandwidth_bytes_per_sec": memory_bandwidth,
        "in_graph_rms_relative_error": local_rms,
    }
    log(
        f"  fit: TensorFlow's all-reduce {format_seconds(call)} per call, "
        f"{format_seconds(launch)} per collective, bandwidth {bandwidth / 1e9:.2f} GB/s per "
        f"replica (rms relative error {rms:.0%}); in graph: {format_seconds(local_call)} per "
        f"call, {format_seconds(handoff)} per hand-off, memory {memory_bandwidth / 1e9:.2f} GB/s "
        f"(rms relative error {local_rms:.0%})"
    )

    # The model's real gradient: its trainable variables' shapes, priced as "auto" prices them.
    shapes = model_gradient_shapes(model)
    tensors = [(int(np.prod(s)) * 4, "float32") for s in shapes]
    comparisons = {}
    for option in torus_schedule.ALGORITHMS_AND_NATIVE:
        predicted = (call if option == "native" else local_call) + _model_terms(
            n, mesh.shape, tensors, option, **figures
        )
        med, lo, hi = timed(option, shapes)
        comparisons[option] = {
            "predicted_seconds": predicted,
            "measured_seconds": med,
            "measured_min": lo,
            "measured_max": hi,
            "ratio": predicted / med,
        }
        log(
            f"  {model} via {option}: predicted {format_seconds(predicted)}, measured "
            f"{format_seconds(med)} (min {format_seconds(lo)}, max {format_seconds(hi)}), "
            f"predicted/measured {predicted / med:.2f}"
        )
    best = min(comparisons, key=lambda o: comparisons[o]["predicted_seconds"])
    log(
        f"  'auto' picks {best}; measured fastest: "
        f"{min(comparisons, key=lambda o: comparisons[o]['measured_seconds'])}"
    )
    return {
        "machine": "8 virtual CPU replicas (mesh 2x4) on this host, float32",
        "allocator": "bfc"
        if os.environ.get("TF_CPU_ALLOCATOR_USE_BFC", "").lower() in ("1", "true")
        else "default",
        "model": model,
        "gradient_bytes": int(sum(b for b, _ in tensors)),
        "num_tensors": len(shapes),
        "repeats": repeats,
        "fit": fit_summary,
        "cpu_figures": figures,
        "points": local + native,
        "comparisons": comparisons,
        "auto": best,
    }


def _nonnegative_lstsq(a, t):
    """Least squares with every coefficient >= 0 (drops negative ones and refits)."""
    keep = list(range(a.shape[1]))
    while True:
        coef = np.zeros(a.shape[1])
        sol, *_ = np.linalg.lstsq(a[:, keep], t, rcond=None)
        coef[keep] = sol
        negative = [i for i in keep if coef[i] < 0]
        if not negative:
            return coef
        keep.remove(min(negative, key=lambda i: coef[i]))


def model_gradient_shapes(model):
    """Trainable variable shapes of a known Keras model, or one flat tensor of `MODELS[model]`
    parameters."""
    builders = {
        "resnet50": "ResNet50",
        "resnet101": "ResNet101",
        "resnet152": "ResNet152",
        "mobilenet_v2": "MobileNetV2",
        "efficientnet_b0": "EfficientNetB0",
    }
    if model not in MODELS:
        raise ValueError(f"Unknown model {model!r}; known models: {sorted(MODELS)}.")
    if model not in builders:
        return [[MODELS[model]]]
    import keras

    net = getattr(keras.applications, builders[model])(weights=None)
    shapes = [list(v.shape) for v in net.trainable_variables]
    del net
    keras.backend.clear_session()
    return shapes
