"""The default training recipe against learning-rate sweeps and plain Keras, on real digits.

Data: scikit-learn's `load_digits()` (1797 greyscale 8x8 handwritten digits, 10 classes, shipped
inside the scikit-learn wheel), a fixed stratified split of 1400 training and 397 test images,
at their own 8x8 size (`IMAGE_SIZE`) and tiled to 3 channels, fed from in-memory numpy arrays
through `tf.data`.

Model: `tpu_scale.models.small_resnet(10, image_size=8)`, trained with `model.fit` on 8 virtual CPU
replicas (`tpu_scale.create_strategy(num_cpu_replicas=8)`) for a fixed budget of epochs at global
batches 32, 64, 256 and 1024; top-1 on the test split at the end. Variants, each over several seeds:

    default    `tpu_scale.schedules.recipe_for_batch(batch, total_epochs=...)`, as it comes: grouped
               batch norm, the 2-D torus gradient sum, label smoothing 0.1.
    sgd@LR     the same with momentum SGD and peak LR `LR` (a small sweep; the best point reported).
    lars@LR    the same with LARS and peak LR `LR` (a small sweep; the best point is reported).
    keras      plain Keras: `keras.layers.BatchNormalization` (per-replica statistics), momentum SGD
               at 0.1 per 256 examples (Goyal et al., 2017) under the same warmup and decay, no
               label smoothing, TensorFlow's native gradient all-reduce.

Every variant of one batch size runs in one process on one traced model per (model, optimizer) pair:
the peak learning rate is a variable, and each run restarts from that seed's initial weights with
zeroed optimizer state.

Usage:
    nice -n 10 python benchmarks/recipe.py            # full run: 4 batches, 2 seeds, ~1 hour
    nice -n 10 python benchmarks/recipe.py --quick    # 1 seed, batches 64 and 1024, one sweep point
    nice -n 10 python benchmarks/recipe.py --batches 32 --sgd_lrs 0.07 0.28 0.56 \
        --lars_lrs 2 4 8                              # one batch's rows, the README's batch 32

Adds its runs to `benchmarks/results/recipe.json` (a run of the same batch, variant and seed
replaces the earlier one; `--fresh` and `--quick` start over) and redraws
`benchmarks/results/recipe.png` from them all.

Two processes, `--gradient_dtypes`: does carrying the gradient sum between hosts in bfloat16
(`create_strategy(gradient_dtype="bfloat16")`) change convergence? In one process no phase crosses a
host, so it would change nothing; this mode runs, for each dtype, a localhost cluster of 2 worker
processes x 4 CPU replicas (`tpu_scale.testing.run_workers`, a `MultiWorkerMirroredStrategy`, mesh
2x4 with a row per worker; one cluster per dtype, as a process holds one such strategy). Each worker
trains the default variant only, the same model, data, loss and evaluation as above, one traced
model per batch, every seed; the data are sharded between the workers by example. Per run: the
chief's top-1 and loss, the other worker's top-1 and how far the workers' weights differ (trainable
ones must agree; the batch-norm moving statistics are each worker's own). Per cluster and batch: the
algorithm the gradient sum ran (`--gradient_algorithm`, default "auto": the planner's recorded
choice and predicted times), the schedule's phases between processes and their bytes per step, and
the collective ops of `fit`'s traced step by dtype, where a bfloat16 run shows its bfloat16
all-reduces over one replica per worker.

    nice -n 10 python benchmarks/recipe.py --gradient_dtypes float32 bfloat16 \
        --batches 256 1024 --seeds 0 1 2    # the default batches and seeds; 8 min on 2 cores

Writes `benchmarks/results/recipe_transport.json` (runs of the same batch, dtype and seed replace
earlier ones unless `--fresh`; other epochs or algorithm start over) with a summary per batch and
dtype: top-1 mean, min, max over seeds, mean loss, and the difference of the means against float32
next to float32's seed spread (max - min); and `recipe_transport.png`.
"""

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
JSON_PATH = os.path.join(RESULTS, "recipe.json")
PNG_PATH = os.path.join(RESULTS, "recipe.png")
TRANSPORT_JSON_PATH = os.path.join(RESULTS, "recipe_transport.json")

IMAGE_SIZE = 8
TEST_EXAMPLES = 397
REPLICAS = 8

# Sweep points around each batch's default (the default's own family also runs the default).
SETTINGS = {
    True: {
        "batches": [64, 1024],
        "seeds": [0],
        "epochs": 15,
        "sgd_lrs": {64: [], 1024: [0.4]},
        "lars_lrs": {64: [4.0], 1024: []},
    },
    False: {
        "batches": [32, 64, 256, 1024],
        "seeds": [0, 1],
        "epochs": 15,
        "sgd_lrs": {
            32: [0.07, 0.28, 0.56],
            64: [0.1, 0.4, 0.8],
            256: [0.2, 0.8, 1.6],
            1024: [0.4, 0.8, 1.6],
        },
        "lars_lrs": {
            32: [2.0, 4.0, 8.0],
            64: [2.0, 4.0, 8.0],
            256: [4.0, 8.0, 16.0],
            1024: [8.0, 12.5, 50.0],
        },
    },
}


def load_digits_split():
    """The digits images as float32 (n, 16, 16, 3), standardized, and int labels: train, test."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0
    images = (images - images.mean()) / images.std()
    scale = IMAGE_SIZE // 8
    images = np.repeat(np.repeat(images, scale, axis=1), scale, axis=2)
    images = np.repeat(images[..., None], 3, axis=-1)
    x_train, x_test, y_train, y_test = train_test_split(
        images,
        digits.target.astype(np.int32),
        test_size=TEST_EXAMPLES,
        random_state=0,
        stratify=digits.target,
    )
    return (x_train, y_train), (x_test, y_test)


def _keras_bn_model(model):
    """`model` with every batch norm replaced by Keras's own (same settings, per-replica
    statistics)."""
    import keras

    from tpu_scale.layers import DistributedBatchNormalization

    def clone(layer):
        if isinstance(layer, DistributedBatchNormalization):
            config = layer.get_config()
            config.pop("group_size")
            return keras.layers.BatchNormalization.from_config(config)
        return layer.__class__.from_config(layer.get_config())

    return keras.models.clone_model(model, clone_function=clone)


def plain_keras_recipe(batch, epochs):
    """The plain-Keras baseline's settings at global batch `batch`: momentum SGD at 0.1 per 256
    examples (Goyal et al., 2017) on the default recipe's warmup and decay, no label smoothing.

    Its `build_optimizer` gives `keras.optimizers.SGD` on that schedule."""
    from tpu_scale import schedules

    recipe = schedules.recipe_for_batch(batch, total_epochs=epochs)
    return dataclasses.replace(
        recipe, optimizer="sgd", peak_learning_rate=0.1 * batch / 256, label_smoothing=0.0
    )


def build_model(seed, keras_bn=False):
    """`small_resnet` with seed `seed`'s initial weights; with `keras_bn`, Keras's batch norm."""
    import keras

    from tpu_scale import models

    keras.utils.set_random_seed(seed)
    model = models.small_resnet(10, image_size=IMAGE_SIZE)
    return _keras_bn_model(model) if keras_bn else model


def steps_per_epoch_of(batch, examples):
    return max(1, examples // batch)


def compile_variant(strategy, variant, epochs, steps_per_epoch, keras_bn=False):
    """The model of one (model, optimizer) pair under `strategy`, compiled with `variant`'s
    optimizer on its warmup and decay, whose peak learning rate is a variable: `(model, peak)`.
    Every run on it sets the weights, zeroes the optimizer state and assigns `peak` (`train_run`).
    """
    import keras

    from tpu_scale import losses, schedules

    with strategy.scope():
        model = build_model(0, keras_bn)
        peak = keras.Variable(1.0, trainable=False, name="peak_learning_rate")
        shape = schedules.WarmupPolynomialDecay.from_epochs(
            1.0, variant.warmup_epochs, epochs, steps_per_epoch, power=variant.decay_power
        )
        holder = []
        optimizer = variant.build_optimizer(
            steps_per_epoch,
            epochs,
            learning_rate=(
                lambda peak=peak, shape=shape, holder=holder: peak * shape(holder[0].iterations)
            ),
        )
        holder.append(optimizer)
        model.compile(
            optimizer=optimizer,
            loss=losses.SmoothedSparseCategoricalCrossentropy(
                variant.label_smoothing, from_logits=True
            ),
        )
    return model, peak


def train_run(model, peak, evaluator, lr, seed, batch, epochs, data, keras_bn=False, options=None):
    """One run on a compiled model: seed `seed`'s initial weights, zeroed optimizer state, peak LR
    `lr`, `epochs` epochs of `data` (`load_digits_split()`) at global batch `batch`; `evaluator` (a
    model of the same architecture outside any strategy) scores the test split.

    Returns `(top_1, final_loss, test_logits)`; `final_loss` is `fit`'s loss of its one epoch that
    spans the whole run. `options`: `tf.data.Options` for the training data (e.g. its sharding
    between workers)."""
    import keras
    import numpy as np
    import tensorflow as tf

    (x, y), (x_test, y_test) = data
    steps_per_epoch = steps_per_epoch_of(batch, len(x))
    model.set_weights(build_model(seed, keras_bn).get_weights())
    for v in model.optimizer.variables:
        v.assign(tf.zeros_like(v))
    peak.assign(lr)
    keras.utils.set_random_seed(seed)
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=seed)
        .repeat()
        .batch(batch, drop_remainder=True)
        .prefetch(2)
    )
    if options is not None:
        dataset = dataset.with_options(options)
    history = model.fit(dataset, epochs=1, steps_per_epoch=epochs * steps_per_epoch, verbose=0)
    evaluator.set_weights(model.get_weights())
    logits = evaluator.predict(x_test, batch_size=TEST_EXAMPLES, verbose=0)
    top_1 = float(np.mean(np.argmax(logits, -1) == y_test))
    return top_1, float(history.history["loss"][-1]), logits


def run_batch(batch, cfg, out, out_path):
    """Trains every variant at global batch `batch` for every seed; adds each run to `out` and saves
    `out` to `out_path` after each."""
    import tpu_scale
    from tpu_scale import schedules

    data = load_digits_split()
    epochs = cfg["epochs"]
    steps_per_epoch = steps_per_epoch_of(batch, len(data[0][0]))
    recipe = schedules.recipe_for_batch(batch, total_epochs=epochs)
    strategies = {
        "torus": tpu_scale.create_strategy(num_cpu_replicas=REPLICAS),
        "native": tpu_scale.create_strategy(num_cpu_replicas=REPLICAS, gradient_reduction="native"),
    }

    # (name, optimizer, peak LRs, keras BN + native + no smoothing?)
    families = [
        ("sgd", "sgd", cfg["sgd_lrs"][batch], False),
        ("lars", "lars", cfg["lars_lrs"][batch], False),
        ("keras", "sgd", [plain_keras_recipe(batch, epochs).peak_learning_rate], True),
    ]
    default_family = recipe.optimizer
    # Plain Keras and the default first: a run cut short still holds the comparison that matters.
    families.sort(key=lambda f: (f[0] != "keras", f[0] != default_family))
    for family, optimizer_name, lrs, plain in families:
        lrs = list(lrs)
        if family == default_family:
            lrs = [("default", recipe.peak_learning_rate)] + [
                (f"{family}@{lr:g}", lr) for lr in lrs
            ]
        elif family != "keras" and not lrs:
            continue
        elif family == "keras":
            lrs = [("keras", lrs[0])]
        else:
            lrs = [(f"{family}@{lr:g}", lr) for lr in lrs]
        strategy = strategies["native" if plain else "torus"]
        variant = schedules.Recipe(**{**recipe.__dict__, "optimizer": optimizer_name})
        if plain:
            variant = schedules.Recipe(**{**variant.__dict__, "label_smoothing": 0.0})
        model, peak = compile_variant(strategy, variant, epochs, steps_per_epoch, plain)
        evaluator = build_model(0, plain)
        for name, lr in lrs:
            for seed in cfg["seeds"]:
                start = time.perf_counter()
                top_1, loss, _ = train_run(
                    model, peak, evaluator, lr, seed, batch, epochs, data, keras_bn=plain
                )
                add_run(
                    out,
                    {
                        "batch": batch,
                        "variant": name,
                        "family": family,
                        "optimizer": optimizer_name,
                        "peak_learning_rate": lr,
                        "seed": seed,
                        "top_1": top_1,
                        "final_loss": loss,
                        "seconds": round(time.perf_counter() - start, 1),
                    },
                )
                save(out, out_path)
                print(
                    f"  batch {batch} {name} (lr {lr:g}) seed {seed}: top-1 {top_1:.3f}, "
                    f"loss {loss:.3f}, {time.perf_counter() - start:.0f} s",
                    flush=True,
                )


# --------------------------------------------------------------------------- two processes


def _gradient_tensors(model):
    """`[(num_bytes, dtype), ...]` of the model's trainable variables: what `fit` sums, as the
    planner is asked about it."""
    import numpy as np
    import tensorflow as tf

    return [
        (int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size, tf.as_dtype(v.dtype).name)
        for v in model.trainable_weights
    ]


def _transport_plan(strategy, tensors):
    """What the gradient sum ran on `strategy` for the gradient `tensors`: the algorithm (under
    `"auto"`, the planner's recorded choice and its predicted times), the dtype between processes,
    the schedule's phases that cross between processes and the bytes they send per step."""
    from tpu_scale import keras_hook, torus, torus_schedule
    from tpu_scale.plan import choice as plan_choice

    settings = keras_hook.settings_for(strategy)
    planner = strategy.gradient_planner
    info = {"settings": repr(settings), "mesh": list(strategy.mesh.shape)}
    algorithm = settings.algorithm
    if algorithm == "auto":
        # The planner decides at the first trace of `fit`'s step, keyed by the gradient it saw.
        picked = [a for (_, key), a in planner.choices.items() if list(key) == tensors]
        if len(picked) != 1:
            raise RuntimeError(f"no planner choice for this gradient; it holds {planner.choices}")
        algorithm = picked[0]
        info["planner"] = plan_choice.choose_algorithm(
            planner.cluster, tensors, planner.pack_bytes or 0, planner.transport_dtype
        ).summary()
    info["algorithm"] = algorithm
    info["transport_dtype"] = settings.gradient_dtype or "float32"
    if algorithm == "native":
        return info
    mesh = strategy.mesh
    host_of = lambda replica: int(replica) // mesh.shape[1]  # noqa: E731  (a row per worker)
    phases = [p for stream in torus.build_schedule(mesh, 0, algorithm).streams for p in stream]
    info["phases_between_processes"] = [
        f"{p.kind} in groups of {p.group_size}"
        for p in phases
        if torus_schedule.phase_between_hosts(p, host_of)
    ]
    # Bytes sent between the processes per step, from the schedule the executor runs: one fused
    # buffer per `pack_bytes` (phases outside a process are collectives, so it fuses), padded.
    itemsize = 4
    sizes = [b for b, _ in tensors]
    wires = {"float32": itemsize, info["transport_dtype"]: 2 if settings.gradient_dtype else 4}
    crossing = dict.fromkeys(wires, 0)
    for pack in torus.pack_indices(sizes, settings.pack_bytes):
        schedule = torus.buffer_schedule(mesh, sum(sizes[i] for i in pack), itemsize, algorithm)
        for name, wire in wires.items():
            crossing[name] += torus.bytes_sent_between(
                torus.transport_schedule(schedule, host_of, itemsize, wire), host_of
            )
    info["bytes_between_processes_per_step"] = crossing
    return info


def _collectives_in(model):
    """The collective ops of `model.fit`'s traced step: `{"type dtype group_size": count}`. The
    gradient phases between processes are the collectives over one replica per worker."""
    from tpu_scale.testing import collective_ops, group_size, train_graphs

    counts = {}
    for graph in train_graphs(model):
        for op in collective_ops(graph):
            key = f"{op.type} {op.get_attr('T').name} group {group_size(op)}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def transport_worker(gradient_dtype, gradient_algorithm, batches, seeds, epochs):
    """Runs in each worker process of a 2-worker cluster (`run_workers("recipe:transport_worker")`):
    the default recipe at every batch and seed, gradient sums between the workers in
    `gradient_dtype`. Returns its runs (with final weights, to compare workers) and what ran."""
    import numpy as np
    import tensorflow as tf

    # One thread per op: the worker's replicas already share the cores.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import tpu_scale
    from tpu_scale import schedules

    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"]),
        gradient_dtype=gradient_dtype,
        gradient_algorithm=gradient_algorithm,
    )
    data = load_digits_split()
    # Each worker reads every example and keeps its replicas' share of every global batch.
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    runs, plans = [], {}
    for batch in batches:
        recipe = schedules.recipe_for_batch(batch, total_epochs=epochs)
        model, peak = compile_variant(
            strategy, recipe, epochs, steps_per_epoch_of(batch, len(data[0][0]))
        )
        evaluator = build_model(0)
        for seed in seeds:
            start = time.perf_counter()
            top_1, loss, logits = train_run(
                model,
                peak,
                evaluator,
                recipe.peak_learning_rate,
                seed,
                batch,
                epochs,
                data,
                options=options,
            )
            runs.append(
                {
                    "batch": batch,
                    "seed": seed,
                    "top_1": top_1,
                    "final_loss": loss,
                    "test_cross_entropy": _cross_entropy(logits, data[1][1]),
                    "seconds": round(time.perf_counter() - start, 1),
                    "trainable": [np.asarray(w) for w in model.trainable_weights],
                    "non_trainable": [np.asarray(w) for w in model.non_trainable_weights],
                }
            )
        plans[batch] = _transport_plan(strategy, _gradient_tensors(model))
        plans[batch]["collective_ops"] = _collectives_in(model)
        plans[batch]["recipe"] = dataclasses.asdict(recipe)
    return {
        "task": strategy.cluster_resolver.task_id,
        "num_replicas": strategy.num_replicas_in_sync,
        "runs": runs,
        "plans": plans,
    }


def _cross_entropy(logits, labels):
    import numpy as np

    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(-np.mean(log_p[np.arange(len(labels)), labels]))


def run_transport(cfg, dtypes, algorithm, out, out_path, timeout):
    """One 2-worker x 4-replica cluster per gradient dtype, each training the default recipe at
    every batch and seed of `cfg`; adds the chief's runs to `out` and saves it after each cluster.
    """
    import numpy as np

    from tpu_scale.testing import run_workers

    if HERE not in sys.path:
        sys.path.insert(0, HERE)  # the workers import this file as `recipe`
    for dtype in dtypes:
        start = time.perf_counter()
        print(f"gradient_dtype {dtype}: 2 workers x {REPLICAS // 2} CPU replicas", flush=True)
        results = run_workers(
            "recipe:transport_worker",
            num_workers=2,
            cpus_per_worker=REPLICAS // 2,
            kwargs={
                "gradient_dtype": dtype,
                "gradient_algorithm": algorithm,
                "batches": cfg["batches"],
                "seeds": cfg["seeds"],
                "epochs": cfg["epochs"],
            },
            timeout=timeout,
        )
        seconds = round(time.perf_counter() - start, 1)
        chief, other = sorted(results, key=lambda r: r["task"])
        for mine, theirs in zip(chief["runs"], other["runs"]):
            differences = {
                part: float(
                    max(np.max(np.abs(x - y)) for x, y in zip(mine.pop(part), theirs.pop(part)))
                )
                for part in ("trainable", "non_trainable")
            }
            plan = chief["plans"][mine["batch"]]
            add_transport_run(
                out,
                {
                    "batch": mine["batch"],
                    "gradient_dtype": dtype,
                    "seed": mine["seed"],
                    "top_1": mine["top_1"],
                    "final_loss": mine["final_loss"],
                    "test_cross_entropy": mine["test_cross_entropy"],
                    "seconds": mine["seconds"],
                    "algorithm": plan["algorithm"],
                    "transport_dtype": plan["transport_dtype"],
                    "top_1_other_worker": theirs["top_1"],
                    # Trainable weights must match; the batch-norm moving statistics are each
                    # worker's own (its groups' batches), and the test top-1 uses them.
                    "max_abs_difference_between_workers": differences,
                },
            )
        cluster = out["clusters"].setdefault(dtype, {"per_batch": {}})
        cluster.update(
            workers=len(results),
            replicas=chief["num_replicas"],
            gradient_algorithm_setting=algorithm,
            seconds=seconds,
            other_worker_same_plan=chief["plans"] == other["plans"],
        )
        cluster["per_batch"].update({str(b): p for b, p in chief["plans"].items()})
        save(out, out_path)
        for r in out["runs"]:
            if r["gradient_dtype"] == dtype:
                print(
                    f"  batch {r['batch']} seed {r['seed']}: top-1 {r['top_1']:.3f} (other worker "
                    f"{r['top_1_other_worker']:.3f}), loss {r['final_loss']:.3f}, "
                    f"{r['algorithm']} with {r['transport_dtype']} between processes, "
                    f"{r['seconds']:.0f} s",
                    flush=True,
                )
        print(f"  cluster: {seconds:.0f} s", flush=True)


def add_transport_run(out, run):
    """Adds `run`, replacing an earlier one of the same batch, gradient dtype and seed."""
    key = (run["batch"], run["gradient_dtype"], run["seed"])
    out["runs"] = [
        r for r in out["runs"] if (r["batch"], r["gradient_dtype"], r["seed"]) != key
    ] + [run]
    out["summary"] = summarize_transport(out["runs"])


def summarize_transport(runs):
    """Per batch and gradient dtype: top-1 mean, min and max over seeds, the mean loss; per batch,
    each dtype's difference of means against float32 next to float32's seed spread (max - min),
    and its difference seed by seed."""
    table = {}
    for batch, dtypes in _by_batch(sorted(runs, key=lambda r: r["seed"]), "gradient_dtype"):
        row = {}
        for dtype, rs in dtypes.items():
            row[dtype] = {
                **_top_1_range(rs),
                "seeds": [r["seed"] for r in rs],
                "mean_final_loss": statistics.mean(r["final_loss"] for r in rs),
                "mean_test_cross_entropy": statistics.mean(r["test_cross_entropy"] for r in rs),
                "algorithm": sorted({r["algorithm"] for r in rs}),
                "transport_dtype": sorted({r["transport_dtype"] for r in rs}),
            }
        base = row.get("float32")
        for dtype, v in row.items():
            if base is not None and dtype != "float32":
                same = [r for r in dtypes[dtype] if r["seed"] in base["seeds"]]
                spread = base["max"] - base["min"]
                v["mean_minus_float32"] = v["mean"] - base["mean"]
                v["float32_seed_spread"] = spread
                v["within_float32_spread"] = abs(v["mean"] - base["mean"]) <= spread
                # Paired by seed: the same initial weights and data order under both dtypes.
                v["per_seed_minus_float32"] = {
                    str(r["seed"]): r["top_1"] - b["top_1"]
                    for r in same
                    for b in dtypes["float32"]
                    if b["seed"] == r["seed"]
                }
        table[str(batch)] = row
    return table


def print_transport_table(summary):
    print(
        "batch | gradient dtype | top-1 mean [min, max] | mean loss | vs float32 (spread); by seed"
    )
    for batch, row in summary.items():
        for dtype, v in row.items():
            versus = ""
            if "mean_minus_float32" in v:
                seeds = " ".join(f"{d:+.3f}" for d in v["per_seed_minus_float32"].values())
                versus = f"{v['mean_minus_float32']:+.3f} ({v['float32_seed_spread']:.3f}); {seeds}"
            print(
                f"{batch} | {dtype} | {v['mean']:.3f} [{v['min']:.3f}, {v['max']:.3f}] | "
                f"{v['mean_final_loss']:.3f} | {versus}"
            )


def plot_transport(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted(int(b) for b in summary)
    dtypes = sorted({d for row in summary.values() for d in row}, key=lambda d: d != "float32")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, dtype in enumerate(dtypes):
        shown = [b for b in batches if dtype in summary[str(b)]]
        vals = [summary[str(b)][dtype] for b in shown]
        means = [v["mean"] for v in vals]
        err = [
            [m - v["min"] for m, v in zip(means, vals)],
            [v["max"] - m for m, v in zip(means, vals)],
        ]
        xs = [b * (1 + 0.05 * (i - (len(dtypes) - 1) / 2)) for b in shown]
        ax.errorbar(xs, means, yerr=err, marker="o", capsize=3, label=f"{dtype} between hosts")
    _save_top_1_plot(
        fig,
        ax,
        batches,
        "global batch size (2 workers x 4 replicas)",
        "digits, small_resnet, default recipe: gradient dtype between hosts",
        path,
    )


# --------------------------------------------------------------------------- results


def add_run(out, run):
    """Adds `run` to `out["runs"]`, replacing an earlier run of the same batch, variant and seed."""
    key = (run["batch"], run["variant"], run["seed"])
    out["runs"] = [r for r in out["runs"] if (r["batch"], r["variant"], r["seed"]) != key] + [run]
    out["summary"] = summarize(out["runs"])


def merge_settings(old, new):
    """The settings of a results file that holds runs of both `old` and `new` settings (dicts as in
    `SETTINGS`, LR lists keyed by batch as int or, read back from JSON, str), or None when their
    epoch budgets differ and the runs cannot share a table."""
    if old is None or old.get("epochs") != new["epochs"]:
        return None
    old_batches = {int(b) for b in old["batches"]}
    merged = {
        "batches": sorted(old_batches | set(new["batches"])),
        "seeds": sorted(set(old["seeds"]) | set(new["seeds"])),
        "epochs": new["epochs"],
    }
    for key in ("sgd_lrs", "lars_lrs"):
        lrs = {int(b): set(v) for b, v in old[key].items() if int(b) in old_batches}
        for b in new["batches"]:
            lrs[b] = lrs.get(b, set()) | set(new[key][b])
        merged[key] = {b: sorted(v) for b, v in sorted(lrs.items())}
    return merged


def save(out, path):
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


def _by_batch(runs, key):
    """`(batch, {run[key]: [runs]})` for each batch in increasing order, runs in their order."""
    for batch in sorted({r["batch"] for r in runs}):
        groups = {}
        for r in runs:
            if r["batch"] == batch:
                groups.setdefault(r[key], []).append(r)
        yield batch, groups


def _top_1_range(runs):
    accs = [r["top_1"] for r in runs]
    return {"mean": statistics.mean(accs), "min": min(accs), "max": max(accs)}


def summarize(runs):
    """Per batch: mean, min and max top-1 of every variant, the best sweep point per family."""
    table = {}
    for batch, rows in _by_batch(runs, "variant"):
        variants = {}
        for name, rs in rows.items():
            variants[name] = {
                "family": rs[0]["family"],
                "peak_learning_rate": rs[0]["peak_learning_rate"],
                **_top_1_range(rs),
                "seeds": len(rs),
            }
        best = {}
        for family in ("sgd", "lars"):
            points = {n: v for n, v in variants.items() if v["family"] == family}
            if points:
                name = max(points, key=lambda n: points[n]["mean"])
                best[family] = name
        table[str(batch)] = {"variants": variants, "best": best}
    return table


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted(int(b) for b in summary)
    series = {
        "default recipe": lambda t: t["variants"]["default"],
        "best swept momentum SGD": lambda t: t["variants"][t["best"]["sgd"]],
        "best swept LARS": lambda t: t["variants"][t["best"]["lars"]],
        "plain Keras (0.1 per 256)": lambda t: t["variants"]["keras"],
    }
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, (label, pick) in enumerate(series.items()):
        xs = [b * (1 + 0.04 * (i - 1.5)) for b in batches]
        vals = [pick(summary[str(b)]) for b in batches]
        means = [v["mean"] for v in vals]
        err = [
            [m - v["min"] for m, v in zip(means, vals)],
            [v["max"] - m for m, v in zip(means, vals)],
        ]
        ax.errorbar(xs, means, yerr=err, marker="o", capsize=3, label=label)
    _save_top_1_plot(
        fig,
        ax,
        batches,
        "global batch size (8 replicas)",
        "digits, small_resnet, fixed epoch budget",
        path,
    )


def _save_top_1_plot(fig, ax, batches, xlabel, title, path):
    """The axes both plots share (batches on a log scale, top-1 with its seed range), saved."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test top-1 (mean, min-max over seeds)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(summary):
    print("batch | default | best SGD | best LARS | plain Keras")
    for batch, t in summary.items():
        v = t["variants"]

        def cell(name, v=v):
            r = v[name]
            return f"{r['mean']:.3f} [{r['min']:.3f}, {r['max']:.3f}] ({name})"

        print(
            f"{batch} | {cell('default')} | {cell(t['best']['sgd'])} | {cell(t['best']['lars'])} | "
            f"{cell('keras')}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batches", type=int, nargs="*")
    parser.add_argument("--seeds", type=int, nargs="*")
    parser.add_argument("--epochs", type=int)
    parser.add_argument("--sgd_lrs", type=float, nargs="*")
    parser.add_argument("--lars_lrs", type=float, nargs="*")
    parser.add_argument(
        "--gradient_dtypes",
        nargs="+",
        choices=("float32", "bfloat16"),
        help="the two-process mode: the default recipe on 2 workers x 4 replicas, one cluster per "
        "dtype of the gradient sum between the workers",
    )
    parser.add_argument(
        "--gradient_algorithm",
        default="auto",
        help="with --gradient_dtypes: create_strategy's gradient_algorithm, for every dtype",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600, help="with --gradient_dtypes: seconds per cluster"
    )
    parser.add_argument("--out", help=f"default {JSON_PATH}, or {TRANSPORT_JSON_PATH}")
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="replace --out instead of adding to its runs (--quick does)",
    )
    args = parser.parse_args()
    if args.gradient_dtypes:
        return main_transport(args)
    args.out = args.out or JSON_PATH
    cfg = dict(SETTINGS[args.quick])
    for key in ("batches", "seeds", "epochs"):
        if getattr(args, key):
            cfg[key] = getattr(args, key)
    for key in ("sgd_lrs", "lars_lrs"):
        if getattr(args, key) is not None:
            cfg[key] = {b: getattr(args, key) for b in cfg["batches"]}
    import tensorflow as tf

    # One thread per op: the 8 replicas already share the cores.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    out = {"settings": cfg, "runs": [], "recipe": {}}
    # The runs of other batches, sweep points and seeds already in --out stay; a run of the same
    # batch, variant and seed is replaced. A quick run replaces the file, as it always did: its one
    # seed and single sweep points must not mix into a full table.
    if os.path.exists(args.out) and not (args.fresh or args.quick):
        with open(args.out) as f:
            old = json.load(f)
        settings = merge_settings(old.get("settings"), cfg)
        if settings is None:
            print(f"{args.out} holds runs of another epoch budget; replacing it", flush=True)
        else:
            out = {"settings": settings, "runs": old["runs"], "recipe": old.get("recipe", {})}
    from tpu_scale import schedules

    for b in cfg["batches"]:
        recipe = schedules.recipe_for_batch(b, total_epochs=cfg["epochs"])
        out["recipe"][str(b)] = dataclasses.asdict(recipe)
    out["recipe"] = dict(sorted(out["recipe"].items(), key=lambda kv: int(kv[0])))
    out["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    for batch in cfg["batches"]:
        run_batch(batch, cfg, out, args.out)
    plot(out["summary"], PNG_PATH if args.out == JSON_PATH else args.out[:-5] + ".png")
    print_table(out["summary"])


def main_transport(args):
    """`--gradient_dtypes`: the default recipe on 2 workers per dtype, into its own results file."""
    out_path = args.out or TRANSPORT_JSON_PATH
    cfg = {
        "batches": args.batches or [256, 1024],
        "seeds": args.seeds or [0, 1, 2],
        "epochs": args.epochs or SETTINGS[False]["epochs"],
        "workers": 2,
        "replicas_per_worker": REPLICAS // 2,
        "gradient_algorithm": args.gradient_algorithm,
    }
    out = {"settings": cfg, "runs": [], "clusters": {}}
    # Runs of other batches, seeds and dtypes already in --out stay when the epochs and algorithm
    # match; a run of the same batch, dtype and seed is replaced.
    if os.path.exists(out_path) and not args.fresh:
        with open(out_path) as f:
            old = json.load(f)
        keys = ("epochs", "workers", "replicas_per_worker", "gradient_algorithm")
        if any(old["settings"].get(k) != cfg[k] for k in keys):
            print(f"{out_path} holds runs of other settings; replacing it", flush=True)
        else:
            out = {"settings": dict(cfg), "runs": old["runs"], "clusters": old["clusters"]}
            for k in ("batches", "seeds"):
                out["settings"][k] = sorted(set(old["settings"][k]) | set(cfg[k]))
    out["command"] = " ".join(["python", "benchmarks/recipe.py"] + sys.argv[1:])
    out["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count()}
    start = time.perf_counter()
    run_transport(cfg, args.gradient_dtypes, args.gradient_algorithm, out, out_path, args.timeout)
    out["seconds"] = round(time.perf_counter() - start, 1)
    save(out, out_path)
    plot_transport(out["summary"], out_path[: -len(".json")] + ".png")
    print_transport_table(out["summary"])
    print(f"{out_path}: {out['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
