"""Calibration: fits the cost model's alpha and bandwidth on this machine's 8 CPU replicas (TensorFlow).

The only part of the planner that starts TensorFlow; `python -m tpu_scale.plan --calibrate` runs it.
"""

import math
import time

import numpy as np

from tpu_scale import torus_schedule
from tpu_scale.plan.catalog import MODELS, uniform_cluster
from tpu_scale.plan.cost import pack_sizes, price_schedule
from tpu_scale.plan.report import format_bytes, format_seconds

def _median_time(fn, repeats):
    fn()  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(min(times)), float(max(times))


def calibrate(sizes=(2 ** 12, 2 ** 18, 2 ** 21, 2 ** 23), repeats=5, model="resnet50", log=print):
    """Fits alpha and bandwidth on this machine's 8 CPU replicas and checks the fit against a real summation.

    Times `collectives.group_sum` (float32) in one `strategy.run` call: over groups of 2, 4 and 8 replicas of a
    `(2, 4)` mesh at several sizes, and 1 or 8 small sums in a row. Fits
    `T = call + collectives * (launch + alpha * steps) + ring_bytes / bandwidth` by non-negative least squares.
    Then sums the model's real gradient shapes with `torus.all_reduce_sum` (each algorithm) and with one native
    `group_sum` per tensor, and reports predicted over measured time (ratio < 1: the model is optimistic).

    Must run before TensorFlow starts anything else in the process (it creates the 8 logical CPUs).

    Returns:
      dict with the fitted figures, the fit points and, per method, predicted and measured seconds and ratio.
    """
    import tensorflow as tf

    from tpu_scale import collectives, torus
    from tpu_scale.strategy import create_strategy

    strategy = create_strategy(num_cpu_replicas=8, mesh_shape=(2, 4), gradient_reduction="native")

    mesh = strategy.mesh
    n = mesh.num_replicas

    def timed(step_fn, shapes):
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: [tf.fill(s, tf.cast(ctx.replica_id_in_sync_group + 1, tf.float32)) for s in shapes])

        @tf.function
        def run(v):
            out = tf.nest.flatten(strategy.run(step_fn, args=(v,)))
            return strategy.experimental_local_results(out[0])[0][:1]

        return _median_time(lambda: run(values).numpy(), repeats)

    def fit_point(groups, size, count):
        g = groups.shape[1]
        elements = size // 4

        def step(v):
            x = v[0]
            for _ in range(count):
                x = collectives.group_sum(x, groups) * 0.5
            return [x]

        med, lo, hi = timed(step, [[elements]])
        log(f"  fit point: {count} sum(s) over groups of {g}, {format_bytes(size)}: {format_seconds(med)} "
            f"(min {format_seconds(lo)}, max {format_seconds(hi)})")
        return {"group_size": g, "bytes": size, "collectives": count, "steps": 2 * (g - 1),
                "ring_bytes": 2 * (g - 1) / g * size, "seconds": med, "min": lo, "max": hi}

    everyone = np.arange(n).reshape(1, n)
    points = [fit_point(everyone, sizes[0], count) for count in (1, 8)]
    for size in sizes:
        for groups in (mesh.column_groups(), mesh.row_groups(), everyone):
            points.append(fit_point(groups, size, 1))
    a = np.array([[1.0, p["collectives"], p["collectives"] * p["steps"], p["collectives"] * p["ring_bytes"]]
                  for p in points])
    t = np.array([p["seconds"] for p in points])
    coef = _nonnegative_lstsq(a, t)
    call, launch, alpha, beta = (float(c) for c in coef)
    bandwidth = 1.0 / beta if beta > 0 else math.inf
    residual = a @ coef - t
    fit = {"call_seconds": call, "launch_seconds": launch, "alpha_seconds": alpha,
           "bandwidth_bytes_per_sec": bandwidth, "rms_relative_error": float(np.sqrt(np.mean((residual / t) ** 2)))}
    log(f"  fit: {format_seconds(call)} per call, {format_seconds(launch)} per collective, alpha "
        f"{format_seconds(alpha)} per step, bandwidth {bandwidth / 1e9:.2f} GB/s per replica "
        f"(rms relative error {fit['rms_relative_error']:.0%})")

    # The model's real gradient: its trainable variables' shapes.
    shapes = model_gradient_shapes(model)
    tensor_bytes = [int(np.prod(s)) * 4 for s in shapes]
    # Eight replicas share this machine's memory and cores: one resource for every phase.
    cluster = uniform_cluster(mesh, alpha, bandwidth, shared=True, name="8 CPU replicas (fitted)",
                              phase_overhead=launch)
    comparisons = {}

    def compare(label, predicted, step_fn):
        med, lo, hi = timed(step_fn, shapes)
        comparisons[label] = {"predicted_seconds": predicted, "measured_seconds": med, "measured_min": lo,
                              "measured_max": hi, "ratio": predicted / med}
        log(f"  {model} via {label}: predicted {format_seconds(predicted)}, measured {format_seconds(med)} "
            f"(min {format_seconds(lo)}, max {format_seconds(hi)}), predicted/measured {predicted / med:.2f}")

    for alg in torus_schedule.ALGORITHMS:
        predicted = call + sum(
            price_schedule(torus_schedule.build_schedule(
                mesh, 4 * torus_schedule.padded_length(pack // 4, mesh, alg), alg), cluster)["seconds"]
            for pack in pack_sizes(tensor_bytes))
        compare(f"torus.all_reduce_sum/{alg}", predicted, lambda v, alg=alg: torus.all_reduce_sum(v, algorithm=alg))
    # One native group sum per tensor: each a ring all-reduce over everyone, one after another.
    predicted = call + sum(price_schedule(torus_schedule.build_schedule(mesh, b, "ring"), cluster)["seconds"]
                           for b in tensor_bytes)
    compare("group_sum per tensor", predicted, lambda v: [collectives.group_sum(x, everyone) for x in v])
    return {
        "machine": "8 virtual CPU replicas (mesh 2x4) on this host, float32",
        "model": model,
        "gradient_bytes": int(sum(tensor_bytes)),
        "num_tensors": len(shapes),
        "repeats": repeats,
        "fit": fit,
        "points": points,
        "comparisons": comparisons,
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
    """Trainable variable shapes of a known Keras model, or one flat tensor of `MODELS[model]` parameters."""
    builders = {"resnet50": "ResNet50", "resnet101": "ResNet101", "resnet152": "ResNet152",
                "mobilenet_v2": "MobileNetV2", "efficientnet_b0": "EfficientNetB0"}
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
