"""Does carrying the gradient sum between hosts in bfloat16 change what training reaches?

Claim: `create_strategy(gradient_dtype="bfloat16")` (the gradient phases between hosts in bfloat16,
everything else in float32) ends at the same test top-1 as float32, within float32's own spread over
seeds. In one process no phase crosses a host, so the question needs several: for each dtype, a
localhost cluster of 2 worker processes x 4 CPU replicas (`tpu_scale.testing.run_workers`, a
`MultiWorkerMirroredStrategy`, mesh 2x4 with a row per worker; one cluster per dtype, as a process
holds one such strategy).

Data: scikit-learn's `load_digits()` (1797 greyscale 8x8 digits, 10 classes), a fixed stratified
split of 1400 training and 397 test images at 8x8, tiled to 3 channels, from in-memory arrays; each
worker reads every example and keeps its replicas' share of every global batch. Model:
`tpu_scale.models.small_resnet(10, input_shape=(8, 8, 3))` on `recipe.recipe_for_batch` (what the run
knows: batch, epochs, steps per epoch, training examples), `model.fit`, one traced model per batch,
every seed restarting from that seed's initial weights with zeroed optimizer state.

Per run: the chief's test top-1 and loss, the other worker's top-1, and how far the workers' weights
differ (trainable ones must agree; the batch-norm moving statistics are each worker's own). Per
dtype and batch: the algorithm the gradient sum ran (under "auto", the planner's choice and its
predicted times), the schedule's phases between processes and their bytes per step, and the
collective ops of `fit`'s traced step by dtype (a bfloat16 run shows bfloat16 all-reduces over one
replica per worker).

Usage (not a timing benchmark; about 30 minutes on 2 shared cores):
    nice -n 10 python benchmarks/gradient_dtypes.py                     # batches 64 256, seeds 0-2
    nice -n 10 python benchmarks/gradient_dtypes.py --batches 256 --seeds 0 --epochs 1  # smoke run

Writes `benchmarks/results/gradient_dtypes.json` (`--out`) and the plot beside it (`.png`).
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # runnable from a checkout, as the workers are
sys.path.insert(0, HERE)  # the workers import this file as `gradient_dtypes`

from common import RESULTS, machine_info  # noqa: E402

IMAGE_SIZE = 8
TEST_EXAMPLES = 397
WORKERS = 2
REPLICAS_PER_WORKER = 4

# --------------------------------------------------------------------------- one worker


def load_digits_split():
    """The digits as standardized float32 (n, 8, 8, 3) images and int32 labels: train, test."""
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = digits.images.astype(np.float32) / 16.0
    images = (images - images.mean()) / images.std()
    images = np.repeat(images[..., None], 3, axis=-1)
    x_train, x_test, y_train, y_test = train_test_split(
        images,
        digits.target.astype(np.int32),
        test_size=TEST_EXAMPLES,
        random_state=0,
        stratify=digits.target,
    )
    return (x_train, y_train), (x_test, y_test)


def build_model(seed):
    """`small_resnet` with seed `seed`'s initial weights."""
    import keras

    from tpu_scale import models

    keras.utils.set_random_seed(seed)
    return models.small_resnet(10, input_shape=(IMAGE_SIZE, IMAGE_SIZE, 3))


def train_run(model, evaluator, seed, batch, epochs, data, options):
    """One run on the compiled `model`: seed `seed`'s initial weights, zeroed optimizer state,
    `epochs` epochs of `data` at global batch `batch`; `evaluator` (the same architecture outside
    any strategy) scores the test split. Returns `(top_1, final_loss, test_logits)`."""
    import keras
    import numpy as np
    import tensorflow as tf

    (x, y), (x_test, y_test) = data
    model.set_weights(build_model(seed).get_weights())
    for v in model.optimizer.variables:
        v.assign(tf.zeros_like(v))
    keras.utils.set_random_seed(seed)
    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=seed)
        .repeat()
        .batch(batch, drop_remainder=True)
        .prefetch(2)
        .with_options(options)
    )
    steps = epochs * max(1, len(x) // batch)
    history = model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0)
    evaluator.set_weights(model.get_weights())
    logits = evaluator.predict(x_test, batch_size=TEST_EXAMPLES, verbose=0)
    top_1 = float(np.mean(np.argmax(logits, -1) == y_test))
    return top_1, float(history.history["loss"][-1]), logits


def cross_entropy(logits, labels):
    import numpy as np

    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(-np.mean(log_p[np.arange(len(labels)), labels]))


def gradient_tensors(model):
    """`[(num_bytes, dtype), ...]` of the trainable variables: what `fit` sums, as the planner is
    asked about it."""
    import numpy as np
    import tensorflow as tf

    return [
        (int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size, tf.as_dtype(v.dtype).name)
        for v in model.trainable_weights
    ]


def transport_plan(strategy, tensors):
    """What the gradient sum ran on `strategy` for the gradient `tensors`: the algorithm (under
    "auto", the rule's recorded choice, and the planner's predicted times), the dtype between processes,
    the schedule's phases that cross between processes and the bytes they send per step."""
    from tpu_scale import keras_hook
    from tpu_scale.plan import choice as plan_choice
    from tpu_scale.plan import report as plan_report
    from tpu_scale.torus import all_reduce as torus
    from tpu_scale.torus import schedule as torus_schedule

    settings = keras_hook.settings_for(strategy)
    rule = strategy.auto_algorithm
    info = {"settings": repr(settings), "mesh": list(strategy.mesh.shape)}
    algorithm = settings.algorithm
    if algorithm == "auto":
        # The rule decides at the first trace of `fit`'s step, keyed by the gradient it saw.
        picked = [a for (_, key), a in rule.choices.items() if list(key) == tensors]
        if len(picked) != 1:
            raise RuntimeError(f"no 'auto' choice for this gradient; it holds {rule.choices}")
        algorithm = picked[0]
        hardware = plan_report.strategy_hardware(strategy)
        if hardware is not None:  # what the planner would price for the same gradient
            info["planner"] = plan_choice.choose_algorithm(
                hardware, tensors, settings.pack_bytes or 0, settings.gradient_dtype
            ).summary()
    info["algorithm"] = algorithm
    info["wire_dtype"] = settings.gradient_dtype or "float32"
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
    wires = {"float32": itemsize, info["wire_dtype"]: 2 if settings.gradient_dtype else 4}
    crossing = dict.fromkeys(wires, 0)
    for pack in torus.pack_indices(sizes, settings.pack_bytes):
        schedule = torus.buffer_schedule(mesh, sum(sizes[i] for i in pack), itemsize, algorithm)
        for name, wire in wires.items():
            crossing[name] += torus.bytes_sent_between(
                torus.transport_schedule(schedule, host_of, itemsize, wire), host_of
            )
    info["bytes_between_processes_per_step"] = crossing
    return info


def collectives_in(model):
    """The collective ops of `model.fit`'s traced step: `{"type dtype group N": count}`."""
    from tpu_scale.testing import collective_ops, group_size, train_graphs

    counts = {}
    for graph in train_graphs(model):
        for op in collective_ops(graph):
            key = f"{op.type} {op.get_attr('T').name} group {group_size(op)}"
            counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def worker(gradient_dtype, gradient_algorithm, batches, seeds, epochs):
    """Runs in each worker process of a cluster (`run_workers("gradient_dtypes:worker")`): the
    recipe at every batch and seed, gradient sums between the workers in `gradient_dtype`. Returns
    its runs (with final weights, to compare the workers) and what the sum ran."""
    import dataclasses

    import numpy as np
    import tensorflow as tf

    # One thread per op: the worker's replicas already share the cores.
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import tpu_scale
    from tpu_scale import losses
    from tpu_scale.recipe import recipe_for_batch

    strategy = tpu_scale.create_strategy(
        num_cpu_replicas=int(os.environ["TPU_SCALE_CPUS_PER_WORKER"]),
        gradient_dtype=gradient_dtype,
        gradient_algorithm=gradient_algorithm,
    )
    data = load_digits_split()
    train_examples = len(data[0][0])
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    runs, plans = [], {}
    for batch in batches:
        steps_per_epoch = max(1, train_examples // batch)
        recipe = recipe_for_batch(
            batch, epochs, steps_per_epoch=steps_per_epoch, train_examples=train_examples
        )
        with strategy.scope():
            model = build_model(0)
            model.compile(
                optimizer=recipe.build_optimizer(steps_per_epoch, epochs),
                loss=losses.SmoothedSparseCategoricalCrossentropy(
                    recipe.label_smoothing, from_logits=True
                ),
            )
        evaluator = build_model(0)
        for seed in seeds:
            start = time.perf_counter()
            top_1, loss, logits = train_run(model, evaluator, seed, batch, epochs, data, options)
            runs.append(
                {
                    "batch": batch,
                    "seed": seed,
                    "top_1": top_1,
                    "final_loss": loss,
                    "test_cross_entropy": cross_entropy(logits, data[1][1]),
                    "seconds": round(time.perf_counter() - start, 1),
                    "trainable": [np.asarray(w) for w in model.trainable_weights],
                    "non_trainable": [np.asarray(w) for w in model.non_trainable_weights],
                }
            )
        plans[batch] = transport_plan(strategy, gradient_tensors(model))
        plans[batch]["collective_ops"] = collectives_in(model)
        plans[batch]["recipe"] = dataclasses.asdict(recipe)
    return {
        "task": strategy.cluster_resolver.task_id,
        "num_replicas": strategy.num_replicas_in_sync,
        "runs": runs,
        "plans": plans,
    }


# --------------------------------------------------------------------------- the driver


def run_cluster(dtype, args):
    """One 2-worker cluster training every batch and seed with `dtype` between the workers: the
    chief's runs (with the other worker's top-1 and the weights' differences) and its plans."""
    import numpy as np

    from tpu_scale.testing import run_workers

    results = run_workers(
        "gradient_dtypes:worker",
        num_workers=WORKERS,
        cpus_per_worker=REPLICAS_PER_WORKER,
        kwargs={
            "gradient_dtype": dtype,
            "gradient_algorithm": args.gradient_algorithm,
            "batches": args.batches,
            "seeds": args.seeds,
            "epochs": args.epochs,
        },
        timeout=args.timeout,
    )
    chief, other = sorted(results, key=lambda r: r["task"])
    runs = []
    for mine, theirs in zip(chief["runs"], other["runs"]):
        plan = chief["plans"][mine["batch"]]
        # Trainable weights must match; the batch-norm moving statistics are each worker's own.
        differences = {
            part: float(
                max(np.max(np.abs(x - y)) for x, y in zip(mine.pop(part), theirs.pop(part)))
            )
            for part in ("trainable", "non_trainable")
        }
        runs.append(
            dict(
                mine,
                gradient_dtype=dtype,
                algorithm=plan["algorithm"],
                wire_dtype=plan["wire_dtype"],
                top_1_other_worker=theirs["top_1"],
                max_abs_difference_between_workers=differences,
            )
        )
    cluster = {
        "replicas": chief["num_replicas"],
        "other_worker_same_plan": chief["plans"] == other["plans"],
        "per_batch": {str(b): p for b, p in chief["plans"].items()},
    }
    return runs, cluster


def summarize(runs):
    """Per batch and dtype: top-1 mean, min, max over seeds and the mean loss; for bfloat16, the
    difference of means against float32 next to float32's seed spread, and seed by seed."""
    table = {}
    for batch in sorted({r["batch"] for r in runs}):
        row = {}
        for dtype in sorted({r["gradient_dtype"] for r in runs}, key=lambda d: d != "float32"):
            rs = [r for r in runs if (r["batch"], r["gradient_dtype"]) == (batch, dtype)]
            top_1 = {r["seed"]: r["top_1"] for r in rs}
            row[dtype] = {
                "mean": statistics.mean(top_1.values()),
                "min": min(top_1.values()),
                "max": max(top_1.values()),
                "by_seed": top_1,
                "mean_final_loss": statistics.mean(r["final_loss"] for r in rs),
                "mean_test_cross_entropy": statistics.mean(r["test_cross_entropy"] for r in rs),
            }
        base = row.get("float32")
        for dtype, v in row.items():
            if base is None or dtype == "float32":
                continue
            spread = base["max"] - base["min"]
            v["mean_minus_float32"] = v["mean"] - base["mean"]
            v["float32_seed_spread"] = spread
            v["within_float32_spread"] = abs(v["mean_minus_float32"]) <= spread
            # Paired by seed: the same initial weights and data order under both dtypes.
            v["by_seed_minus_float32"] = {
                s: t - base["by_seed"][s] for s, t in v["by_seed"].items() if s in base["by_seed"]
            }
        table[str(batch)] = row
    return table


def plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted(int(b) for b in summary)
    dtypes = list(next(iter(summary.values())))
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, dtype in enumerate(dtypes):
        vals = [summary[str(b)][dtype] for b in batches]
        means = [v["mean"] for v in vals]
        err = [
            [m - v["min"] for m, v in zip(means, vals)],
            [v["max"] - m for m, v in zip(means, vals)],
        ]
        xs = [b * (1 + 0.05 * (i - (len(dtypes) - 1) / 2)) for b in batches]
        ax.errorbar(xs, means, yerr=err, marker="o", capsize=3, label=f"{dtype} between hosts")
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel(f"global batch size ({WORKERS} workers x {REPLICAS_PER_WORKER} replicas)")
    ax.set_ylabel("test top-1 (mean, min-max over seeds)")
    ax.set_title("digits, small_resnet, the recipe: gradient dtype between hosts")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(summary):
    print("| batch | gradient dtype | top-1 mean [min, max] | mean loss | - float32 (its spread) |")
    print("|---|---|---|---|---|")
    for batch, row in summary.items():
        for dtype, v in row.items():
            versus = ""
            if "mean_minus_float32" in v:
                versus = f"{v['mean_minus_float32']:+.3f} ({v['float32_seed_spread']:.3f})"
            print(
                f"| {batch} | {dtype} | {v['mean']:.3f} [{v['min']:.3f}, {v['max']:.3f}] | "
                f"{v['mean_final_loss']:.3f} | {versus} |"
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"]
    )
    parser.add_argument(
        "--batches",
        type=int,
        nargs="+",
        default=[64, 256],
        help="global batches (1400 training images: batch 1024 is one step an epoch, where the "
        "recipe ends near chance under either dtype)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument(
        "--gradient_algorithm",
        default="auto",
        help="create_strategy's gradient_algorithm, for every dtype",
    )
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per cluster")
    parser.add_argument("--out", default=os.path.join(RESULTS, "gradient_dtypes.json"))
    args = parser.parse_args(argv)

    started = time.perf_counter()
    runs, clusters = [], {}
    for dtype in args.dtypes:
        print(
            f"{dtype} between hosts: {WORKERS} workers x {REPLICAS_PER_WORKER} replicas", flush=True
        )
        dtype_runs, clusters[dtype] = run_cluster(dtype, args)
        runs += dtype_runs
        for r in dtype_runs:
            print(
                f"  batch {r['batch']} seed {r['seed']}: top-1 {r['top_1']:.3f} (other worker "
                f"{r['top_1_other_worker']:.3f}), loss {r['final_loss']:.3f}, {r['algorithm']} "
                f"with {r['wire_dtype']} between processes",
                flush=True,
            )
    summary = summarize(runs)
    result = {
        "command": " ".join(["python", "benchmarks/gradient_dtypes.py"] + sys.argv[1:]),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": machine_info(),
        "summary": summary,
        "clusters": clusters,
        "runs": runs,
        "seconds": round(time.perf_counter() - started, 1),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(summary, args.out[: -len(".json")] + ".png")
    print_table(summary)
    print(f"wrote {args.out} in {result['seconds']:.0f} s")


if __name__ == "__main__":
    main()
