"""Grouped batch normalization: what it costs per step, and what it buys in accuracy.

(a) Step time of a small ResNet-style model's `model.fit` training step on 8 virtual CPU replicas,
for
    Keras's local `BatchNormalization`, `DistributedBatchNormalization` at group sizes 1 (local
    statistics: the layer's own cost without communication), 2, 4 and 8, and Keras's
    `BatchNormalization(synchronized=True)`, measured in the same process in many short interleaved
    rounds; per-round ratios to Keras's local BN, and their median.
(b) Accuracy at a per-replica batch of 4 on 16 virtual replicas (global batch 64): Keras's local BN
(span 4),
    `DistributedBatchNormalization` with group spans of 16, 32 and 64 examples, and plain BN over
    the whole batch of 64 on one device (no strategy), on an in-memory image task, in `model.fit`
    with the native gradient all-reduce, for several seeds; final test accuracy of each, and a PNG
    plot. All variants run in one child process with a timeout (`--quick`: about 2.5 minutes on a
    2-core machine).

Usage:
    python benchmarks/batchnorm.py [--quick] [--part time|accuracy]
    python benchmarks/batchnorm.py --plot-only      # redraw the accuracy plot from the results file

Each part runs in its own process (they need 8 and 16 virtual replicas); results are merged into one
file.

Writes `benchmarks/results/batchnorm.json` and `benchmarks/results/batchnorm_accuracy.png`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import RESULTS, machine_info  # noqa: E402

import tpu_scale  # noqa: E402
import tpu_scale.distribute.strategy  # noqa: E402
from tpu_scale.layers import DistributedBatchNormalization  # noqa: E402

# --------------------------------------------------------------------------- models


def _norm(kind):
    """A batch-norm layer factory: "local", "sync" (Keras synchronized) or an int group size."""
    if kind == "local":
        return lambda: keras.layers.BatchNormalization()
    if kind == "sync":
        return lambda: keras.layers.BatchNormalization(synchronized=True)
    return lambda: DistributedBatchNormalization(group_size=kind)


def resnet_style(norm, input_shape=(32, 32, 3), widths=(16, 32, 64), blocks=2, classes=10):
    """A small ResNet: stem, `blocks` basic blocks per stage, global pool, dense."""
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
                shortcut = norm()(
                    keras.layers.Conv2D(width, 1, strides=stride, use_bias=False)(shortcut)
                )
            x = keras.layers.ReLU()(keras.layers.Add()([y, shortcut]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(classes)(x))


def small_convnet(norm, input_shape=(16, 16, 3), widths=(32, 64, 64), classes=10):
    """Three conv + BN + ReLU layers and a linear classifier: quick, with BN on every layer."""
    inputs = keras.Input(input_shape)
    x = inputs
    for width, stride in zip(widths, (1, 2, 2)):
        x = keras.layers.Conv2D(width, 3, strides=stride, padding="same", use_bias=False)(x)
        x = keras.layers.ReLU()(norm()(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(classes)(x))


# --------------------------------------------------------------------------- (a) step time


def _step_times(model, iterator, steps):
    """Wall time of each of `steps` training steps.

    The step function is the one `model.fit` runs once per batch
    (`model.train_function`: data, forward, backward, gradient sum, update), on a long-lived
    iterator.

    Called directly rather than through a `fit` per round: every `fit` makes and deletes a
    distributed iterator, which here cost 1-10 s per call, more than the steps it would time."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logs = model.train_function(iterator)
        float(logs["loss"])  # the step has finished
        times.append(time.perf_counter() - start)
    return times


def step_time(quick):
    strategy = tpu_scale.create_strategy(num_cpu_replicas=8, gradient_reduction="native")
    # Many short rounds rather than a few long ones: the shared machine's slow spells last seconds,
    # and a ratio taken inside one short round sees the same load on both sides.
    per_replica, steps, rounds = 8, 5, (6 if quick else 28)
    blocks = 1 if quick else 2
    global_batch = per_replica * strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    x = rng.normal(size=(global_batch * 4, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=len(x))
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch, drop_remainder=True).repeat()
    )
    dataset = dataset.prefetch(2)

    variants = ["local", 1, 2, 4, 8, "sync"]
    models = {}
    # Each warm-up `fit` ends by deleting its iterators, which can stall under the default policy
    # (see the docstring). Timing runs under the default policy again: it is what users run, and
    # under SCHED_BATCH a replica woken at a barrier waits for its time slice.
    tpu_scale._workarounds.batch_scheduling()
    for kind in variants:
        started = time.perf_counter()
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = resnet_style(_norm(kind), blocks=blocks)
            model.compile(
                keras.optimizers.SGD(0.01, momentum=0.9),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        model.fit(dataset, steps_per_epoch=3, epochs=1, verbose=0)  # trace, build the optimizer
        models[kind] = model
        print(f"  {kind}: built and traced in {time.perf_counter() - started:.0f} s", flush=True)
    tpu_scale._workarounds.batch_scheduling(enabled=False)
    for kind, model in models.items():
        iterator = iter(strategy.experimental_distribute_dataset(dataset))
        _step_times(model, iterator, 2)  # warm up on this iterator
        models[kind] = model, iterator

    per_round = {str(k): [] for k in variants}
    for r in range(rounds):
        # Rotate the order every round so slow drifts of the shared machine do not favour one
        # variant.
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for kind in order:
            per_round[str(kind)].append(statistics.median(_step_times(*models[kind], steps)))
        print(
            f"  round {r + 1}/{rounds}: "
            + ", ".join(f"{k}={per_round[str(k)][-1] * 1e3:.1f}ms" for k in variants),
            flush=True,
        )

    base = statistics.median(per_round["local"])
    table = {}
    for kind in variants:
        times = per_round[str(kind)]
        median = statistics.median(times)
        # Ratio per round (same round = same machine load), then the median of those.
        ratios = [t / b for t, b in zip(times, per_round["local"])]
        table[str(kind)] = {
            "median_ms": median * 1e3,
            "min_ms": min(times) * 1e3,
            "max_ms": max(times) * 1e3,
            "ratio_to_local": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    # The measurement is over: back to SCHED_BATCH before the iterators are released.
    tpu_scale._workarounds.batch_scheduling()
    local_model = models["local"][0]
    bn_layers = sum(isinstance(x, keras.layers.BatchNormalization) for x in local_model.layers)
    return {
        "replicas": 8,
        "per_replica_batch": per_replica,
        "input": [32, 32, 3],
        "blocks_per_stage": blocks,
        "bn_layers": bn_layers,
        "params": int(local_model.count_params()),
        "steps_per_round": steps,
        "rounds": rounds,
        "baseline_median_ms": base * 1e3,
        "variants": table,
    }


# --------------------------------------------------------------------------- (b) accuracy


# Settings of part (b). Quick: 12x12 inputs, a narrow net and 192 steps: the five variants x two
# seeds take about 2.5 minutes on a 2-core machine (16 replicas meet at a barrier on every grouped
# BN layer and at the gradient sum). Full: 16x16 inputs, the wider net, 4x the data and 512 steps,
# five seeds.
ACCURACY_SETTINGS = {
    True: {
        "size": 12,
        "widths": [16, 32, 32],
        "train_examples": 1536,
        "epochs": 8,
        "seeds": [0, 1],
        "timeout_s": 400,
    },
    False: {
        "size": 16,
        "widths": [32, 64, 64],
        "train_examples": 4096,
        "epochs": 8,
        "seeds": [0, 1, 2, 3, 4],
        "timeout_s": 36000,
    },
}
REPLICAS, PER_REPLICA = 16, 4
# Spans at a per-replica batch of 4: local 4; groups of 4, 8, 16 replicas -> 16, 32, 64 examples;
# and the same global batch of 64 on one device with plain BN.
ACCURACY_VARIANTS = {
    "local BN (span 4)": ("local", 4),
    "group span 16": (4, 16),
    "group span 32": (8, 32),
    "group span 64": (16, 64),
    "one device, whole batch (span 64)": ("one_device", 64),
}


def make_task(n_train, n_test, seed=1234, size=16, classes=10):
    """An in-memory image task: each class is a blocky random colour pattern (4x4-pixel blocks);
    samples are shifted, re-contrasted, re-lit and noisy copies of it. Learnable in a few epochs,
    not trivially."""
    rng = np.random.default_rng(seed)
    coarse = rng.normal(size=(classes, size // 4, size // 4, 3))
    templates = np.kron(coarse, np.ones((1, 4, 4, 1)))

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


def accuracy_variants(quick, out_path):
    """Trains every variant for every seed in this process and writes the accuracies to `out_path`
    after each seed, so a run stopped by the parent's timeout still reports what it finished.

    Each variant's model is built, compiled and traced once; each seed then restarts it from that
    seed's initial weights (and zeroed optimizer state: momentum, step count, hence the
    learning-rate schedule) with that seed's data order. This saves one 16-replica trace per seed
    (10-20 s here)."""
    cfg = ACCURACY_SETTINGS[quick]
    # One intra-op thread per op: 16 replicas already share the cores.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tpu_scale.create_strategy(num_cpu_replicas=REPLICAS, gradient_reduction="native")
    assert strategy.num_replicas_in_sync == REPLICAS
    shape, widths = (cfg["size"], cfg["size"], 3), tuple(cfg["widths"])
    (x, y), (x_test, y_test) = make_task(cfg["train_examples"], 2000, size=cfg["size"])
    global_batch = PER_REPLICA * REPLICAS
    steps = cfg["epochs"] * (len(x) // global_batch)
    evaluator = small_convnet(_norm("local"), shape, widths)

    def initial_weights(seed):
        # Built outside any strategy, with plain BN: the same weight list as every variant's model.
        keras.utils.set_random_seed(seed)
        return small_convnet(_norm("local"), shape, widths).get_weights()

    report = {"steps": steps, "params": int(evaluator.count_params()), "variants": {}}
    for name, (kind, _) in ACCURACY_VARIANTS.items():
        # The whole-batch baseline trains without a strategy: one device, plain BN over all 64
        # examples.
        scope = tf.distribute.get_strategy() if kind == "one_device" else strategy
        with scope.scope():
            model = small_convnet(_norm("local" if kind == "one_device" else kind), shape, widths)
            model.compile(
                keras.optimizers.SGD(
                    keras.optimizers.schedules.CosineDecay(0.1, steps), momentum=0.9
                ),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        runs = report["variants"][name] = []
        for seed in cfg["seeds"]:
            start = time.perf_counter()
            model.set_weights(initial_weights(seed))
            for variable in model.optimizer.variables:
                variable.assign(tf.zeros_like(variable))
            keras.utils.set_random_seed(seed)
            dataset = (
                tf.data.Dataset.from_tensor_slices((x, y))
                .shuffle(len(x), seed=seed)
                .repeat()
                .batch(global_batch, drop_remainder=True)
            )
            # One epoch of all steps: a single iterator per run (ending 16-device iterators is slow
            # here).
            history = model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
            # Evaluate the weights a checkpoint would hold (replica 0's moving statistics) on one
            # device.
            evaluator.set_weights(model.get_weights())
            logits = evaluator.predict(x_test, batch_size=500, verbose=0)
            runs.append(
                {
                    "seed": seed,
                    "accuracy": float(np.mean(np.argmax(logits, -1) == y_test)),
                    "final_train_loss": float(history.history["loss"][-1]),
                    "seconds": time.perf_counter() - start,
                }
            )
            print(
                f"  {name} seed {seed}: accuracy {runs[-1]['accuracy']:.4f} "
                f"(train loss {runs[-1]['final_train_loss']:.3f}, {runs[-1]['seconds']:.0f} s)",
                flush=True,
            )
            with open(out_path, "w") as f:
                json.dump(report, f)


def accuracy(quick):
    """Runs the variants in a child process (16 virtual devices must exist before TensorFlow starts)
    with a timeout, and collects the accuracies."""
    import tempfile

    cfg = ACCURACY_SETTINGS[quick]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    command = [sys.executable, os.path.abspath(__file__), "--accuracy-variants", "--out", out_path]
    status = "done"
    try:
        subprocess.run(
            command + (["--quick"] if quick else []), timeout=cfg["timeout_s"], check=True
        )
    except subprocess.TimeoutExpired:
        status = f"stopped after {cfg['timeout_s']} s"
    except subprocess.CalledProcessError as e:
        status = f"failed (exit {e.returncode})"
    with open(out_path) as f:
        text = f.read()
    os.unlink(out_path)
    report = json.loads(text) if text else {"variants": {}}
    summary = {}
    for name, (kind, span) in ACCURACY_VARIANTS.items():
        runs = report["variants"].get(name, [])
        accs = [r["accuracy"] for r in runs]
        summary[name] = {
            "kind": str(kind),
            "span": span,
            "runs": runs,
            "accuracies": accs,
            "status": "done" if len(runs) == len(cfg["seeds"]) else status,
            "seconds": sum(r["seconds"] for r in runs),
        }
        if accs:
            summary[name].update(
                mean=float(np.mean(accs)),
                std=float(np.std(accs)),
                min=float(np.min(accs)),
                max=float(np.max(accs)),
            )
        print(f"  {name}: {summary[name]['status']}, accuracies {accs}", flush=True)
    return {
        "replicas": REPLICAS,
        "per_replica_batch": PER_REPLICA,
        "global_batch": PER_REPLICA * REPLICAS,
        "input": [cfg["size"], cfg["size"], 3],
        "widths": cfg["widths"],
        "params": report.get("params"),
        "train_examples": cfg["train_examples"],
        "test_examples": 2000,
        "epochs": cfg["epochs"],
        "steps": report.get("steps"),
        "optimizer": "SGD momentum 0.9, lr 0.1 cosine to 0",
        "seeds": cfg["seeds"],
        "gradient_reduction": "native",
        "threads": {"intra_op": 1},
        "variants": summary,
    }


def plot(acc, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    spans, means = [], []
    for name, v in acc["variants"].items():
        if v["kind"] == "one_device" or not v["accuracies"]:
            continue
        values = v["accuracies"]
        jitter = np.linspace(-0.04, 0.04, len(values)) if len(values) > 1 else [0.0]
        ax.scatter(
            [v["span"] * 2**j for j in jitter],
            values,
            color="tab:blue",
            alpha=0.6,
            s=22,
            zorder=3,
            label="per seed" if not spans else None,
        )
        spans.append(v["span"])
        means.append(np.mean(values))
    ax.plot(
        spans,
        means,
        "o-",
        color="tab:blue",
        markersize=9,
        markerfacecolor="white",
        zorder=2,
        label=f"BN over the span on {acc['replicas']} replicas (span 4: local), mean",
    )
    whole = [v for v in acc["variants"].values() if v["kind"] == "one_device" and v["accuracies"]]
    if whole:
        values = whole[0]["accuracies"]
        ax.axhline(
            np.mean(values),
            color="tab:orange",
            linestyle="--",
            label="one device, whole batch 64, mean",
        )
        ax.axhspan(
            min(values),
            max(values),
            color="tab:orange",
            alpha=0.15,
            label="whole batch, seed range",
        )
    ax.set_xscale("log", base=2)
    ax.set_xticks(spans)
    ax.set_xticklabels(
        [
            f"{s}\n"
            + (
                "(local)"
                if s == acc["per_replica_batch"]
                else f"({s // acc['per_replica_batch']} replicas)"
            )
            for s in spans
        ]
    )
    ax.set_xlabel("BN span (examples normalized together)")
    ax.set_ylabel("test accuracy")
    ax.set_title(
        f"Accuracy vs. BN span: {acc['replicas']} replicas x {acc['per_replica_batch']} examples, "
        f"{acc['steps']} steps, {len(acc['seeds'])} seeds",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer repeats, seeds, steps and a smaller model"
    )
    parser.add_argument("--part", choices=["all", "time", "accuracy"], default="all")
    parser.add_argument(
        "--accuracy-variants", action="store_true", help=argparse.SUPPRESS
    )  # internal: (b)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument(
        "--plot-only",
        action="store_true",
        help="redraw the accuracy plot from the results file without training",
    )
    args = parser.parse_args(argv)
    if args.accuracy_variants:
        # Ending a 16-replica fit must not stall (see its docstring). Not for part (a): under
        # SCHED_BATCH a replica woken at a barrier waits for its time slice, which would skew the
        # step times it measures.
        tpu_scale._workarounds.batch_scheduling()
        accuracy_variants(args.quick, args.out)
        return 0
    os.makedirs(RESULTS, exist_ok=True)
    out_path = os.path.join(RESULTS, "batchnorm.json")
    plot_path = os.path.join(RESULTS, "batchnorm_accuracy.png")
    if args.plot_only:
        with open(out_path) as f:
            plot(json.load(f)["accuracy"], plot_path)
        return 0
    if args.part == "all":
        # One process per part: the two parts need different replica counts, and logical devices are
        # fixed when TensorFlow starts.
        for part in ("time", "accuracy"):
            command = [sys.executable, os.path.abspath(__file__), "--part", part] + (
                ["--quick"] if args.quick else []
            )
            subprocess.run(command, check=True)
        return 0
    results = {}
    results["machine"] = machine_info()
    results["commands"] = {
        args.part: "python benchmarks/batchnorm.py"
        + (" --quick" if args.quick else "")
        + f" --part {args.part}"
    }
    if args.part == "time":
        # Devices must exist before TensorFlow starts: 8 replicas for (a).
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 8
        )
        print("(a) step time, 8 replicas", flush=True)
        results["step_time"] = step_time(args.quick)
    if args.part == "accuracy":
        print(f"(b) accuracy, {REPLICAS} replicas x {PER_REPLICA} examples", flush=True)
        start = time.perf_counter()
        results["accuracy"] = accuracy(args.quick)
        results["accuracy"]["wall_seconds"] = time.perf_counter() - start
        plot(results["accuracy"], plot_path)
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
