"""The default training recipe against learning-rate sweeps and plain Keras, on real digits.

Data: scikit-learn's `load_digits()` (1797 greyscale 8x8 handwritten digits, 10 classes, shipped
inside the scikit-learn wheel), a fixed stratified split of 1400 training and 397 test images,
upsampled to 16x16 and tiled to 3 channels, fed from in-memory numpy arrays through `tf.data`.

Model: `tpu_scale.models.small_resnet(10, image_size=16)`, trained with `model.fit` on 8 virtual CPU
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

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
JSON_PATH = os.path.join(RESULTS, "recipe.json")
PNG_PATH = os.path.join(RESULTS, "recipe.png")

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


def run_batch(batch, cfg, out, out_path):
    """Trains every variant at global batch `batch` for every seed; adds each run to `out` and saves
    `out` to `out_path` after each."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tpu_scale
    from tpu_scale import losses, models, schedules

    (x, y), (x_test, y_test) = load_digits_split()
    epochs = cfg["epochs"]
    steps_per_epoch = max(1, len(x) // batch)
    recipe = schedules.recipe_for_batch(batch, total_epochs=epochs)
    strategies = {
        "torus": tpu_scale.create_strategy(num_cpu_replicas=REPLICAS),
        "native": tpu_scale.create_strategy(num_cpu_replicas=REPLICAS, gradient_reduction="native"),
    }

    def build(seed, keras_bn):
        keras.utils.set_random_seed(seed)
        model = models.small_resnet(10, image_size=IMAGE_SIZE)
        return _keras_bn_model(model) if keras_bn else model

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
        with strategy.scope():
            model = build(0, plain)
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
        evaluator = build(0, plain)
        for name, lr in lrs:
            for seed in cfg["seeds"]:
                start = time.perf_counter()
                model.set_weights(build(seed, plain).get_weights())
                for v in model.optimizer.variables:
                    v.assign(tf.zeros_like(v))
                peak.assign(lr)
                keras.utils.set_random_seed(seed)
                data = (
                    tf.data.Dataset.from_tensor_slices((x, y))
                    .shuffle(len(x), seed=seed)
                    .repeat()
                    .batch(batch, drop_remainder=True)
                    .prefetch(2)
                )
                history = model.fit(
                    data, epochs=1, steps_per_epoch=epochs * steps_per_epoch, verbose=0
                )
                evaluator.set_weights(model.get_weights())
                logits = evaluator.predict(x_test, batch_size=TEST_EXAMPLES, verbose=0)
                top_1 = float(np.mean(np.argmax(logits, -1) == y_test))
                loss = float(history.history["loss"][-1])
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


def summarize(runs):
    """Per batch: mean, min and max top-1 of every variant, the best sweep point per family."""
    table = {}
    for batch in sorted({r["batch"] for r in runs}):
        rows = {}
        for r in runs:
            if r["batch"] == batch:
                rows.setdefault(r["variant"], []).append(r)
        variants = {}
        for name, rs in rows.items():
            accs = [r["top_1"] for r in rs]
            variants[name] = {
                "family": rs[0]["family"],
                "peak_learning_rate": rs[0]["peak_learning_rate"],
                "mean": statistics.mean(accs),
                "min": min(accs),
                "max": max(accs),
                "seeds": len(accs),
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
    ax.set_xscale("log", base=2)
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("global batch size (8 replicas)")
    ax.set_ylabel("test top-1 (mean, min-max over seeds)")
    ax.set_title("digits, small_resnet, fixed epoch budget")
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
    parser.add_argument("--out", default=JSON_PATH)
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="replace --out instead of adding to its runs (--quick does)",
    )
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
