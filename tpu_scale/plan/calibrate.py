"""Calibration: fits the CPU cost figures on this machine's 8 CPU replicas (TensorFlow).

The only part of the planner that starts TensorFlow; `python -m tpu_scale.plan --calibrate` runs it.
"""

import math
import time

import numpy as np

from tpu_scale.plan.catalog import MODELS
from tpu_scale.plan.report import format_bytes, format_seconds


def _median_time(fn, repeats):
    fn()  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(min(times)), float(max(times))


def calibrate(sizes=(2**12, 2**18, 2**21, 2**23), repeats=5, model="resnet50", log=print):
    """Fits the CPU figures on this machine's 8 CPU replicas and checks them against real
    summations.

    Collective ops: times `collectives.group_sum` (float32) in one `strategy.run` call over groups
    of 2, 4 and 8 replicas of a `(2, 4)` mesh at several sizes, and 1 or 8 small sums in a row, and
    fits `T = call + collectives * (launch + alpha * steps) + ring_bytes / bandwidth`. In-graph
    sums: times `group_sum(..., in_graph=True)` over all 8 at the same sizes and fits `T = call +
    sums * 2 * op + sums * 25 * bytes / memory_bandwidth` (the sum's eight reads and one write, and
    the step's halving on every replica). Both by non-negative least squares. Then sums the model's
    real gradient shapes with every option `"auto"` can pick (`plan.choice.OPTIONS`: each algorithm
    of `torus.all_reduce_sum` and the strategy's native all-reduce) and reports predicted over
    measured time (ratio < 1: the model is optimistic).

    Must run before TensorFlow starts anything else in the process (it creates the 8 logical CPUs).

    Returns:
      dict with the fitted figures (`cpu_figures`, the keys of `catalog.CPU_FIGURES`), the fit
      points and, per option, predicted and measured seconds and their ratio.
    """
    import tensorflow as tf

    from tpu_scale import collectives, torus
    from tpu_scale.strategy import create_strategy

    strategy = create_strategy(num_cpu_replicas=8, mesh_shape=(2, 4), gradient_reduction="native")

    mesh = strategy.mesh
    n = mesh.num_replicas

    def timed(step_fn, shapes):
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: [
                tf.fill(s, tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)) for s in shapes
            ]
        )

        @tf.function
        def run(v):
            # Every output is returned: plain ops whose results nothing reads would be pruned.
            return strategy.run(step_fn, args=(v,))

        return _median_time(lambda: run(values), repeats)

    def fit_point(groups, size, count, in_graph=False):
        g = groups.shape[1]
        elements = size // 4

        def step(v):
            x = v[0]
            for _ in range(count):
                x = collectives.group_sum(x, groups, in_graph=in_graph) * 0.5
            return [x]

        med, lo, hi = timed(step, [[elements]])
        label = "in-graph sum(s)" if in_graph else "collective sum(s)"
        log(
            f"  fit point: {count} {label} over groups of {g}, {format_bytes(size)}: "
            f"{format_seconds(med)} (min {format_seconds(lo)}, max {format_seconds(hi)})"
        )
        return {
            "group_size": g,
            "bytes": size,
            "collectives": count,
            "steps": 2 * (g - 1),
            "ring_bytes": 2 * (g - 1) / g * size,
            "in_graph": in_graph,
            "seconds": med,
            "min": lo,
            "max": hi,
        }

    everyone = np.arange(n).reshape(1, n)
    points = [fit_point(everyone, sizes[0], count) for count in (1, 8)]
    for size in sizes:
        for groups in (mesh.column_groups(), mesh.row_groups(), everyone):
            points.append(fit_point(groups, size, 1))
    a = np.array(
        [
            [
                1.0,
                p["collectives"],
                p["collectives"] * p["steps"],
                p["collectives"] * p["ring_bytes"],
            ]
            for p in points
        ]
    )
    t = np.array([p["seconds"] for p in points])
    coef = _nonnegative_lstsq(a, t)
    call, launch, alpha, beta = (float(c) for c in coef)
    bandwidth = 1.0 / beta if beta > 0 else math.inf
    rms = float(np.sqrt(np.mean(((a @ coef - t) / t) ** 2)))

    local = [fit_point(everyone, sizes[0], count, in_graph=True) for count in (1, 8)]
    local += [fit_point(everyone, size, 1, in_graph=True) for size in sizes[1:]]
    # Each fit step also halves the sum on every replica: n more reads and writes of the buffer.
    b = np.array(
        [[1.0, 2.0 * p["collectives"], p["collectives"] * (3 * n + 1) * p["bytes"]] for p in local]
    )
    u = np.array([p["seconds"] for p in local])
    local_coef = _nonnegative_lstsq(b, u)
    _, op_seconds, inverse_memory = (float(c) for c in local_coef)
    memory_bandwidth = 1.0 / inverse_memory if inverse_memory > 0 else math.inf
    local_rms = float(np.sqrt(np.mean(((b @ local_coef - u) / u) ** 2)))
    figures = {
        "call_seconds": call,
        "collective_launch_seconds": launch,
        "collective_alpha": alpha,
        "collective_bandwidth": bandwidth,
        "op_seconds": op_seconds,
        "memory_bandwidth": memory_bandwidth,
    }
    fit = {
        "call_seconds": call,
        "launch_seconds": launch,
        "alpha_seconds": alpha,
        "bandwidth_bytes_per_sec": bandwidth,
        "rms_relative_error": rms,
        "in_graph_op_seconds": op_seconds,
        "memory_bandwidth_bytes_per_sec": memory_bandwidth,
        "in_graph_rms_relative_error": local_rms,
    }
    log(
        f"  fit: {format_seconds(call)} per call, {format_seconds(launch)} per collective, alpha "
        f"{format_seconds(alpha)} per step, bandwidth {bandwidth / 1e9:.2f} GB/s per replica "
        f"(rms relative error {rms:.0%}); in graph: {format_seconds(op_seconds)} per op, memory "
        f"{memory_bandwidth / 1e9:.2f} GB/s (rms relative error {local_rms:.0%})"
    )

    # The model's real gradient: its trainable variables' shapes, priced as "auto" prices them.
    from tpu_scale.plan.catalog import cpu_cluster
    from tpu_scale.plan.choice import OPTIONS, price_option

    shapes = model_gradient_shapes(model)
    tensors = [(int(np.prod(s)) * 4, "float32") for s in shapes]
    cluster = cpu_cluster(1, n, figures, mesh_shape=mesh.shape)
    comparisons = {}
    for option in OPTIONS:
        predicted = call + price_option(cluster, tensors, option)
        med, lo, hi = timed(lambda v, o=option: torus.all_reduce_sum(v, algorithm=o), shapes)
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
        "model": model,
        "gradient_bytes": int(sum(b for b, _ in tensors)),
        "num_tensors": len(shapes),
        "repeats": repeats,
        "fit": fit,
        "cpu_figures": figures,
        "points": points + local,
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
