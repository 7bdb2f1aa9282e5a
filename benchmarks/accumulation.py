"""Gradient accumulation: training throughput at k=4 against k=1, at the same micro-batch.

Claim: accumulating gradients over k=4 micro-batches (`gradient_accumulation_steps=4`) trains at
no less than 0.95x the images/s of plain training at the same micro-batch, under the package's
strategy (its accumulation workaround, `keras_hook.accumulation_needs_phases`).

Setup: the example's default model (`tpu_scale.models.small_resnet`, 10 classes, 64x64 images),
global micro-batch 128, 8 virtual CPU replicas in a 2x4 mesh, the package's gradient sum, LARS.
Each variant's `model.train_function` (the step `model.fit` runs once per batch) runs on a
long-lived iterator over in-memory images, in interleaved rounds of 8 micro-batches (two
accumulated optimizer steps); a round's images/s is 8 x 128 over its wall time.

Usage (timing: hold the machine-wide lock):
    flock /tmp/tpu_scale_timing.lock nice -n 5 python benchmarks/accumulation.py [--rounds N]

Writes `benchmarks/results/accumulation.json`.
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import machine_info, save_result, spread, summarize  # noqa: E402

MICRO_BATCH = 128
IMAGE_SIZE = 64
STEPS_PER_ROUND = 8
ACCUMULATION = 4


def _round(model, iterator):
    """Seconds for `STEPS_PER_ROUND` training steps."""
    start = time.perf_counter()
    for _ in range(STEPS_PER_ROUND):
        logs = model.train_function(iterator)
    float(logs["loss"])  # the steps have finished
    return time.perf_counter() - start


def measure(rounds):
    import keras
    import numpy as np
    import tensorflow as tf

    import tpu_scale
    from tpu_scale import models
    from tpu_scale.optimizers import LARS

    strategy = tpu_scale.create_strategy(num_cpu_replicas=8, mesh_shape=(2, 4))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(MICRO_BATCH * 4, IMAGE_SIZE, IMAGE_SIZE, 3)).astype("float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .batch(MICRO_BATCH, drop_remainder=True)
        .repeat()
        .prefetch(2)
    )
    variants = {}
    for name, steps in (("k=1", None), (f"k={ACCUMULATION}", ACCUMULATION)):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = models.small_resnet(10, input_shape=(IMAGE_SIZE, IMAGE_SIZE, 3))
            model.compile(
                optimizer=LARS(1.0, weight_decay=1e-4, gradient_accumulation_steps=steps),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        # Builds, traces (both phases with accumulation) and warms up.
        model.fit(dataset, steps_per_epoch=ACCUMULATION, epochs=1, verbose=0)
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        _round(model, iterator)
        variants[name] = model, iterator

    seconds = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (model, iterator) in variants.items():
            seconds[name].append(_round(model, iterator))
    images = STEPS_PER_ROUND * MICRO_BATCH
    rates = {name: [images / s for s in times] for name, times in seconds.items()}
    base, accumulated = rates["k=1"], rates[f"k={ACCUMULATION}"]
    per_round = [a / b for a, b in zip(accumulated, base)]
    return {
        "claim": f"k={ACCUMULATION} images/s >= 0.95x k=1 at the same micro-batch",
        "setup": {
            "model": "small_resnet(10)",
            "image_size": IMAGE_SIZE,
            "micro_batch": MICRO_BATCH,
            "replicas": 8,
            "mesh": "2x4",
            "optimizer": "LARS",
            "steps_per_round": STEPS_PER_ROUND,
            "rounds": rounds,
        },
        "images_per_second": {
            "k=1": summarize(base),
            f"k={ACCUMULATION}": summarize(accumulated, baseline=base),
        },
        "per_round_ratio": spread(per_round),
        "met": statistics.median(accumulated) / statistics.median(base) >= 0.95,
        "machine": machine_info(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 rounds instead of 9")
    parser.add_argument("--rounds", type=int, help="timed rounds of each variant (default 9)")
    args = parser.parse_args(argv)
    result = measure(args.rounds or (4 if args.quick else 9))
    save_result("accumulation", result)


if __name__ == "__main__":
    main()
