"""Grouped batch normalization: what it costs per step, and what it buys in accuracy.

(a) Step time of a small ResNet-style model in `model.fit` on 8 virtual CPU replicas, for Keras's local
    `BatchNormalization`, `DistributedBatchNormalization` at group sizes 2, 4 and 8, and Keras's
    `BatchNormalization(synchronized=True)`, measured in the same process in interleaved rounds; medians of
    the per-step times, and ratios to local BN.
(b) Accuracy at a per-replica batch of 4 on 16 virtual replicas: local BN (span 4), group spans of 16, 32
    and 64 examples, and whole-batch BN on one device (span 64, no strategy), on an in-memory image task,
    for several seeds; final test accuracy of each, and a PNG plot.

Usage:
    python benchmarks/batchnorm.py [--quick] [--part time|accuracy]

Each part runs in its own process (they need 8 and 16 virtual replicas); results are merged into one file.

Writes `benchmarks/results/batchnorm.json` and `benchmarks/results/batchnorm_accuracy.png`.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

import tpu_scale  # noqa: E402
from tpu_scale.layers import DistributedBatchNormalization  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# --------------------------------------------------------------------------- models


def _norm(kind):
    """A batch-norm layer factory: "local", "sync" (Keras synchronized) or an int group size."""
    if kind == "local":
        return lambda: keras.layers.BatchNormalization()
    if kind == "sync":
        return lambda: keras.layers.BatchNormalization(synchronized=True)
    return lambda: DistributedBatchNormalization(group_size=kind)


def resnet_style(norm, input_shape=(32, 32, 3), widths=(16, 32, 64), blocks=2, classes=10):
    """A small pre-activation-free ResNet: stem, `blocks` basic blocks per stage, global pool, dense."""
    inputs = keras.Input(input_shape)
    x = keras.layers.Conv2D(widths[0], 3, padding="same", use_bias=False)(inputs)
    x = keras.layers.ReLU()(norm()(x))
    for stage, width in enumerate(widths):
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            y = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(x)
            y = keras.layers.ReLU()(norm()(y))
            y = keras.layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
            y = norm()(y)
            if stride != 1 or shortcut.shape[-1] != width:
                shortcut = norm()(keras.layers.Conv2D(width, 1, strides=stride, use_bias=False)(shortcut))
            x = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(classes)(x))


def small_convnet(norm, input_shape=(16, 16, 3), classes=10):
    """Three conv + BN + ReLU layers and a linear classifier: quick to train, and BN sits on every layer."""
    inputs = keras.Input(input_shape)
    x = inputs
    for width, stride in ((32, 1), (64, 2), (64, 2)):
        x = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(x)
        x = keras.layers.ReLU()(norm()(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(classes)(x))


# --------------------------------------------------------------------------- (a) step time


class _StepTimer(keras.callbacks.Callback):
    """Wall time between consecutive training steps (data, forward, backward, gradient sum, update)."""

    def __init__(self):
        super().__init__()
        self.times, self._last = [], None

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._last is not None:
            self.times.append(now - self._last)
        self._last = now


def step_time(quick):
    strategy = tpu_scale.create_strategy(num_cpu_replicas=8, gradient_reduction="native")
    per_replica, steps, rounds = 8, (10 if quick else 20), (3 if quick else 7)
    blocks = 1 if quick else 2
    global_batch = per_replica * strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch * 4, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=len(x))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True).repeat()
    dataset = dataset.prefetch(2)

    variants = ["local", 2, 4, 8, "sync"]
    models = {}
    for kind in variants:
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = resnet_style(_norm(kind), blocks=blocks)
            model.compile(keras.optimizers.SGD(0.01, momentum=0.9),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(dataset, steps_per_epoch=3, epochs=1, verbose=0)  # trace and warm up
        models[kind] = model

    per_round = {str(k): [] for k in variants}
    for r in range(rounds):
        # Rotate the order every round so slow drifts of the shared machine do not favour one variant.
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for kind in order:
            timer = _StepTimer()
            models[kind].fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[timer])
            per_round[str(kind)].append(statistics.median(timer.times))
        print(f"  round {r + 1}/{rounds}: " + ", ".join(
            f"{k}={per_round[str(k)][-1] * 1e3:.1f}ms" for k in variants), flush=True)

    base = statistics.median(per_round["local"])
    table = {}
    for kind in variants:
        times = per_round[str(kind)]
        median = statistics.median(times)
        # Ratio per round (same round = same machine load), then the median of those.
        ratios = [t / b for t, b in zip(times, per_round["local"])]
        table[str(kind)] = {
            "median_ms": median * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
            "ratio_to_local": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        }
    bn_layers = sum(isinstance(l, keras.layers.BatchNormalization) for l in models["local"].layers)
    return {
        "replicas": 8, "per_replica_batch": per_replica, "input": [32, 32, 3], "blocks_per_stage": blocks,
        "bn_layers": bn_layers,
        "params": int(models["local"].count_params()), "steps_per_round": steps, "rounds": rounds,
        "baseline_median_ms": base * 1e3, "variants": table,
    }


# --------------------------------------------------------------------------- (b) accuracy


def make_task(n_train, n_test, seed=1234, size=16, classes=10):
    """An in-memory image task: each class is a smooth random colour pattern; samples are shifted,
    re-contrasted, re-lit and noisy copies of it. Learnable in a few epochs, not trivially."""
    rng = np.random.default_rng(seed)
    coarse = rng.normal(size=(classes, size // 4, size // 4, 3))
    templates = np.kron(coarse, np.ones((1, 4, 4, 1)))  # blocky 16x16 patterns

    def sample(n):
        labels = rng.integers(0, classes, size=n)
        images = templates[labels]
        shifts = rng.integers(-3, 4, size=(n, 2))
        images = np.stack([np.roll(img, tuple(s), axis=(0, 1)) for img, s in zip(images, shifts)])
        contrast = rng.uniform(0.4, 1.6, size=(n, 1, 1, 1))
        brightness = rng.normal(0.0, 1.0, size=(n, 1, 1, 3))
        noise = rng.normal(0.0, 1.0, size=images.shape)
        return (images * contrast + brightness + noise).astype(np.float32), labels

    return sample(n_train), sample(n_test)


def _train_one(kind, seed, task, epochs, strategy16):
    (x, y), (x_test, y_test) = task
    per_replica, replicas = 4, 16
    global_batch = per_replica * replicas
    # One endless iterator for the whole run: destroying a 16-device iterator at each epoch end can hang.
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=seed).repeat()
               .batch(global_batch, drop_remainder=True))
    if kind == "one_device":
        scope, norm = tf.distribute.get_strategy().scope(), _norm("local")
    else:
        scope, norm = strategy16.scope(), _norm(kind)
    with scope:
        keras.utils.set_random_seed(seed)
        model = small_convnet(norm)
        steps = epochs * (len(x) // global_batch)
        schedule = keras.optimizers.schedules.CosineDecay(0.1, steps)
        model.compile(keras.optimizers.SGD(schedule, momentum=0.9),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(dataset, epochs=epochs, steps_per_epoch=len(x) // global_batch, verbose=0)
    # Evaluate the weights a checkpoint would hold (replica 0's moving statistics) on one device.
    keras.utils.set_random_seed(seed)
    evaluator = small_convnet(_norm("local"))
    evaluator.set_weights(model.get_weights())
    logits = evaluator.predict(x_test, batch_size=256, verbose=0)
    return float(np.mean(np.argmax(logits, -1) == y_test))


def accuracy(quick):
    strategy16 = tpu_scale.create_strategy(num_cpu_replicas=16, gradient_reduction="native")
    seeds = [0, 1] if quick else [0, 1, 2, 3, 4]
    epochs = 3 if quick else 8
    task = make_task(n_train=1536 if quick else 4096, n_test=2000)
    # Spans at a per-replica batch of 4: local 4; groups of 4, 8, 16 replicas -> 16, 32, 64 examples.
    variants = {"local BN (span 4)": "local", "group span 16": 4, "group span 32": 8, "group span 64": 16,
                "one device, whole batch (span 64)": "one_device"}
    results = {name: [] for name in variants}
    for seed in seeds:
        for name, kind in variants.items():
            start = time.perf_counter()
            results[name].append(_train_one(kind, seed, task, epochs, strategy16))
            print(f"  seed {seed} {name}: accuracy {results[name][-1]:.4f} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
    summary = {name: {"accuracies": accs, "mean": float(np.mean(accs)), "std": float(np.std(accs)),
                      "min": float(np.min(accs)), "max": float(np.max(accs))}
               for name, accs in results.items()}
    return {"replicas": 16, "per_replica_batch": 4, "global_batch": 64, "epochs": epochs, "seeds": seeds,
            "train_examples": len(task[0][0]), "test_examples": len(task[1][0]), "variants": summary}


def plot(acc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(acc["variants"])
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, name in enumerate(names):
        values = acc["variants"][name]["accuracies"]
        ax.scatter([i] * len(values), values, color="tab:blue", alpha=0.6)
        ax.errorbar(i, np.mean(values), yerr=np.std(values), fmt="_", color="black", markersize=20, capsize=4)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([n.replace(" (", "\n(") for n in names], fontsize=8)
    ax.set_ylabel("test accuracy")
    ax.set_title(f"Batch-norm span at a per-replica batch of {acc['per_replica_batch']} "
                 f"({acc['replicas']} replicas, {len(acc['seeds'])} seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, seeds and epochs (a few minutes)")
    parser.add_argument("--part", choices=["all", "time", "accuracy"], default="all")
    args = parser.parse_args(argv)
    if args.part == "all":
        # One process per part: the two parts need different replica counts, and two MirroredStrategies in
        # one process would share the collective group keys TensorFlow numbers from 1.
        for part in ("time", "accuracy"):
            command = [sys.executable, os.path.abspath(__file__), "--part", part] + (["--quick"] if args.quick else [])
            subprocess.run(command, check=True)
        return 0
    # Devices must exist before TensorFlow starts: 8 replicas for (a), 16 for (b).
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * (8 if args.part == "time" else 16))
    os.makedirs(RESULTS, exist_ok=True)
    out_path = os.path.join(RESULTS, "batchnorm.json")
    results = {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            results = json.load(f)
    results["machine"] = (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                          f"TF {tf.__version__}, Keras {keras.__version__}")
    results.setdefault("commands", {})[args.part] = "python benchmarks/batchnorm.py" + (
        " --quick" if args.quick else "") + f" --part {args.part}"
    if args.part == "time":
        print("(a) step time, 8 replicas", flush=True)
        results["step_time"] = step_time(args.quick)
    if args.part == "accuracy":
        print("(b) accuracy, 16 replicas x 4 examples", flush=True)
        results["accuracy"] = accuracy(args.quick)
        plot(results["accuracy"], os.path.join(RESULTS, "batchnorm_accuracy.png"))
    # Re-read before writing: the other part may have finished meanwhile.
    merged = {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            merged = json.load(f)
    merged.setdefault("commands", {}).update(results.pop("commands"))
    merged.update(results)
    with open(out_path, "w") as f:
        json.dump(merged, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
