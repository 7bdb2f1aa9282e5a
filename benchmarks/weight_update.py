"""Weight-update sharding: LARS step time at 8 CPU replicas, sharded against replicated.

Claim: with a ResNet-50-sized gradient (26.1 M float32 parameters; ResNet-50 has 25.6 M),
LARS's training step wrapped in `DistributedOptimizer(..., weight_update_sharding=True)` is
no slower than the same step with every replica updating every weight (the package's torus sum,
then Keras's replicated update). With `--workers 2` the 8 replicas are 2 localhost worker
processes x 4 (`MultiWorkerMirroredStrategy`, mesh 2x4), the shards spanning both workers.

Setup: 19 dense layers (widths 1536 to 256, kernels of 0.1-2.4 M parameters, as ResNet-50's
convolutions range) and a tiny forward pass (one example per replica), so that the step is mostly
the gradient sum and the update. Both variants run
`model.train_function` (the step `model.fit` runs per batch) on a long-lived iterator, in
interleaved rounds of 3 steps.

Usage (timing: hold the machine-wide lock):
    flock /tmp/tpu_scale_timing.lock nice -n 5 python benchmarks/weight_update.py [--rounds N]
        [--workers 2]

Writes `benchmarks/results/weight_update.json` (`weight_update_workers.json` with `--workers`).
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from common import machine_info, save_result, spread, summarize  # noqa: E402

STEPS_PER_ROUND = 3
# The dense layers' widths: 26.1 M parameters in all.
WIDTHS = [1536] * 9 + [1024] * 5 + [512] * 4 + [256]


def _round(model, iterator):
    start = time.perf_counter()
    for _ in range(STEPS_PER_ROUND):
        logs = model.train_function(iterator)
    float(logs["loss"])
    return time.perf_counter() - start


def build_model(strategy, sharded=False):
    """The ResNet-50-sized dense model, compiled with LARS under `strategy` (its update sharded
    over the replicas with `sharded`)."""
    import keras

    import tpu_scale
    from tpu_scale.optimizers import LARS

    with strategy.scope():
        keras.utils.set_random_seed(0)
        layers = [keras.Input((WIDTHS[0],))]
        layers += [keras.layers.Dense(w, activation="relu") for w in WIDTHS[1:]]
        layers += [keras.layers.Dense(10)]
        model = keras.Sequential(layers)
        optimizer = LARS(1.0, weight_decay=1e-4)
        if sharded:
            optimizer = tpu_scale.DistributedOptimizer(optimizer, weight_update_sharding=True)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def dataset():
    """One example per replica per step, repeated."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, WIDTHS[0])).astype("float32")
    y = rng.integers(0, 10, size=len(x)).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(8, drop_remainder=True).repeat()


def _timed(rounds, strategies):
    """Builds, fits and traces a model per variant, then times interleaved rounds of steps.

    Args:
      rounds: timed rounds per variant.
      strategies: variant name -> a function returning the strategy to build it under; the
        variant named "sharded" shards the update.

    Returns:
      `{"seconds": {name: per-step seconds per round}, "parameters": n, "state": {name: optimizer
      floats per replica}}`.
    """
    from tpu_scale.torus import weight_update
    data = dataset()
    variants, state, parameters = {}, {}, None
    for name, strategy_for in strategies.items():
        strategy = strategy_for()
        model = build_model(strategy, sharded=name == "sharded")
        parameters = model.count_params()
        model.fit(data, steps_per_epoch=2, epochs=1, verbose=0)
        state[name] = weight_update.floats_per_replica(model.optimizer)
        iterator = iter(strategy.experimental_distribute_dataset(data))
        _round(model, iterator)
        variants[name] = model, iterator
        print(f"  {name}: built and traced", flush=True)
    seconds = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (model, iterator) in variants.items():
            seconds[name].append(_round(model, iterator) / STEPS_PER_ROUND)
    return {"seconds": seconds, "parameters": parameters, "state": state}


def measure_in_worker(rounds):
    """One worker's share of `--workers`: one strategy, the update sharded in one variant."""
    import tpu_scale

    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"])
    )
    return _timed(rounds, {"replicated": lambda: strategy, "sharded": lambda: strategy})


def measure(rounds, workers=1):
    if workers > 1:
        from tpu_scale.testing import run_workers

        timed = run_workers(
            "weight_update:measure_in_worker",
            num_workers=workers,
            cpus_per_worker=8 // workers,
            kwargs={"rounds": rounds},
            timeout=7200,
        )[0]  # the chief's clock: the workers step together
    else:
        import tpu_scale

        strategies = {  # before any TensorFlow op: the 8 CPU devices exist from the start
            name: tpu_scale.create_strategy(num_cpu_replicas=8)
            for name in ("replicated", "sharded")
        }
        timed = _timed(rounds, {name: (lambda s=s: s) for name, s in strategies.items()})
    base, sharded = timed["seconds"]["replicated"], timed["seconds"]["sharded"]
    per_round = [s / b for s, b in zip(sharded, base)]
    return {
        "claim": "sharded LARS step time <= replicated LARS step time (8 CPU replicas)",
        "setup": {
            "parameters": timed["parameters"],
            "replicas": 8,
            "workers": workers,
            "batch_per_replica": 1,
            "optimizer": "LARS",
            "steps_per_round": STEPS_PER_ROUND,
            "rounds": rounds,
        },
        "step_seconds": {
            "replicated": summarize(base),
            "sharded": summarize(sharded, baseline=base),
        },
        "per_round_ratio": spread(per_round),
        "optimizer_floats_per_replica": timed["state"],
        "met": statistics.median(sharded) <= statistics.median(base),
        "machine": machine_info(),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of each variant")
    parser.add_argument(
        "--workers", type=int, default=1, choices=(1, 2), help="worker processes for the 8 replicas"
    )
    args = parser.parse_args(argv)
    result = measure(args.rounds, args.workers)
    save_result("weight_update_workers" if args.workers > 1 else "weight_update", result)


if __name__ == "__main__":
    main()
