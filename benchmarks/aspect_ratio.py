"""Images of every shape (`InputConfig.aspect_ratio`): the ImageNet level reads as before, and what
the whole-image levels cost.

`InputConfig.aspect_ratio` says how a non-square image becomes the square input: "stretch" (the
whole image resized), "pad" (its shape kept, zeros around it) or "crop" (its centred square). The
levels below ImageNet's read the whole image ("stretch"); the ImageNet level keeps Inception's
boxes and the 224/256 centred square. "Today" is the package at `--before_rev` (c77caf6, before
the field), checked out as a git worktree and imported in a process of its own
(`PYTHONPATH=<checkout>`, `tpu_scale.__file__` checked); "now" is this checkout.

  identical  the ImageNet level's inputs are byte-identical to today's: 48 non-square views of
             scikit-learn's two sample photos (4:3, 3:2 and 16:9, landscape and portrait, JPEG
             and PNG, 100-600 px on the long side), written by `data.write_tfrecords` (PNGs
             re-encoded as JPEGs) and, as a second set, stored as they are (PNGs kept), read as
             training batches (`Recipe(augmentation="imagenet").input_config(InputConfig(
             deterministic=True, seed=0))`, two epochs) and evaluation batches, uint8 and float32,
             at 32 and 224, scaled decode on and off, in both trees; `np.array_equal` on images
             and labels. A control: the "none" level's evaluation, which now reads the whole image
             where today's read the centred square, must differ.
  time       images/s and host CPU ms per image (process CPU time over the read) of
             `ImageNetInput`, uint8, training and evaluation, at 224 on views of photos of about
             500x375 (`input_data.py`) and at 32 on views of about 60x45: today's ImageNet level
             against the level now, and the whole-image levels now ("none" with "stretch", "pad",
             "crop") against today's "none". Each contender in a fresh process per round (all
             four readings in it, a warm-up each), the order rotating from round to round;
             medians [min, max] over the rounds, ratios of the medians to today's and the
             spread of the per-round ratios.

Usage (timing: hold the machine-wide lock):
    python benchmarks/aspect_ratio.py --part identical
    flock /tmp/tpu_scale_timing.lock nice -n 5 python benchmarks/aspect_ratio.py --part time \
        [--rounds 5]

Writes `benchmarks/results/aspect_ratio.json` (each part its own key, the other part kept).
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULT_PATH = os.path.join(HERE, "results", "aspect_ratio.json")
BEFORE_REV = "c77caf6"
WORKTREE = "/tmp/tpu_scale_c77caf6"
TIMING_LOCK = "/tmp/tpu_scale_timing.lock"

# Part identical: the views' aspect ratios (long:short), orientations, formats and long sides.
RATIOS = ((4, 3), (3, 2), (16, 9))
LONG_SIDES = (100, 600)

# Part time: the contenders, each (tree, augmentation level, aspect_ratio or None for the level's),
# and the ratio each is read against.
CONTENDERS = {
    "imagenet_today": ("before", "imagenet", None),
    "imagenet_now": ("now", "imagenet", None),
    "none_today": ("before", "none", None),
    "none_stretch_now": ("now", "none", "stretch"),
    "none_pad_now": ("now", "none", "pad"),
    "none_crop_now": ("now", "none", "crop"),
}
BASELINE_OF = {
    "imagenet_now": "imagenet_today",
    "none_stretch_now": "none_today",
    "none_pad_now": "none_today",
    "none_crop_now": "none_today",
}
# Small views of photos, ~60x45 (the shapes of `input_data.py`'s, over 8.33).
SMALL_SHAPES = [(45, 60)] * 6 + [(60, 45), (40, 60), (48, 60), (45, 54)]

# --------------------------------------------------------------------------- in the child process
# The child imports `tpu_scale` from its PYTHONPATH (this checkout or today's), so it imports
# nothing of the benchmarks (`common` puts this checkout first on the path).


def _config(level, aspect_ratio, **fields):
    """The level's `InputConfig` through the recipe, as a run builds it (`fields` first)."""
    from tpu_scale.data import InputConfig
    from tpu_scale.recipe import Recipe

    recipe = Recipe(
        global_batch_size=64,
        optimizer="sgd",
        peak_learning_rate=0.1,
        warmup_epochs=0.0,
        augmentation=level,
    )
    if aspect_ratio is not None:  # a field of the recipe now only
        recipe = dataclasses.replace(recipe, aspect_ratio=aspect_ratio)
    return recipe.input_config(InputConfig(**fields))


def _child_read(spec):
    """Part identical: every reading of `spec["readings"]`, its images and labels saved to
    `spec["arrays"]` (npz)."""
    import numpy as np

    import tpu_scale
    from tpu_scale.data import ImageNetInput

    arrays, configs = {}, {}
    for reading in spec["readings"]:
        config = _config(
            reading["level"],
            None,
            deterministic=True,
            seed=0,
            scaled_decode=reading["scaled_decode"],
        )
        configs[reading["level"]] = {
            k: v for k, v in dataclasses.asdict(config).items() if k != "scaled_decode"
        }
        inp = ImageNetInput(
            reading["pattern"],
            is_training=reading["is_training"],
            global_batch_size=reading["batch_size"],
            image_size=reading["image_size"],
            dtype=reading["dtype"],
            config=config,
        )
        dataset = inp.dataset()
        if reading["is_training"]:
            dataset = dataset.take(reading["batches"])
        images, labels = zip(*((x.numpy(), y.numpy()) for x, y in dataset))
        arrays[reading["name"] + "/images"] = np.concatenate(images)
        arrays[reading["name"] + "/labels"] = np.concatenate(labels)
    np.savez(spec["arrays"], **arrays)
    return {"tpu_scale_file": tpu_scale.__file__, "configs": configs}


def _child_time(spec):
    """Part time: one contender's readings, each timed after a warm-up: images/s and CPU ms per
    image."""
    import tensorflow as tf

    import tpu_scale
    from tpu_scale.data import ImageNetInput

    config = _config(spec["level"], spec["aspect_ratio"])
    out = {
        "tpu_scale_file": tpu_scale.__file__,
        "aspect_ratio": getattr(config, "aspect_ratio", None),
    }
    for reading in spec["readings"]:
        inp = ImageNetInput(
            reading["pattern"],
            is_training=reading["is_training"],
            global_batch_size=reading["batch_size"],
            image_size=reading["image_size"],
            dtype=tf.uint8,
            config=config,
        )
        dataset = inp.dataset()
        if not reading["is_training"]:
            dataset = dataset.repeat()  # evaluation passes one after another
        iterator = iter(dataset)
        for _ in range(reading["warmup_batches"]):
            next(iterator)
        count, start, cpu_start = 0, time.perf_counter(), time.process_time()
        for _ in range(reading["batches"]):
            count += int(next(iterator)[1].shape[0])
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        out[reading["name"]] = {
            "images_per_second": count / seconds,
            "cpu_ms_per_image": 1000 * cpu / count,
            "images": count,
        }
    return out


def child_main(spec_path, output_path):
    with open(spec_path) as f:
        spec = json.load(f)
    result = _child_read(spec) if spec["kind"] == "read" else _child_time(spec)
    with open(output_path, "w") as f:
        json.dump(result, f)


# --------------------------------------------------------------------------- in the driver


class BeforeTree:
    """Today's package at `rev`, as a git worktree at `path` for the length of a `with`."""

    def __init__(self, rev, path=WORKTREE):
        self.rev, self.path = rev, path

    def _git(self, *args):
        return subprocess.run(
            ["git", "-C", ROOT, *args], check=True, capture_output=True, text=True
        ).stdout.strip()

    def __enter__(self):
        commit = self._git("rev-parse", "--verify", f"{self.rev}^{{commit}}")
        if os.path.exists(self.path):
            # A worktree left by a run cut short: reused only at the same commit.
            if self._git("-C", self.path, "rev-parse", "HEAD") != commit:
                raise SystemExit(f"{self.path} holds another commit than {self.rev}: remove it.")
        else:
            self._git("worktree", "add", "--detach", self.path, commit)
        self.commit = commit
        return self

    def __exit__(self, *exc):
        self._git("worktree", "remove", "--force", self.path)


def this_checkout():
    """This checkout's commit, and whether its `tpu_scale/` has changes not committed."""
    git = ["git", "-C", ROOT]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    status = subprocess.run(
        [*git, "status", "--porcelain", "--", "tpu_scale"], capture_output=True, text=True
    )
    return {"commit": commit.stdout.strip(), "tpu_scale_uncommitted": bool(status.stdout.strip())}


def run_in(tree, spec, timeout=1800):
    """Runs this script's child half on `spec` with `tpu_scale` from `tree` (a checkout's root)
    and returns its result."""
    env = dict(os.environ, PYTHONPATH=tree, TF_CPP_MIN_LOG_LEVEL="2", PYTHONDONTWRITEBYTECODE="1")
    with tempfile.TemporaryDirectory(prefix="tpu_scale_aspect_") as workdir:
        spec_path, out = os.path.join(workdir, "spec.json"), os.path.join(workdir, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        command = [sys.executable, os.path.abspath(__file__), "--_child", spec_path, out]
        completed = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout, cwd=workdir
        )
        if completed.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((completed.stdout + completed.stderr).splitlines()[-30:])
            raise RuntimeError(f"child in {tree} failed (exit {completed.returncode}):\n{tail}")
        with open(out) as f:
            result = json.load(f)
    expected = os.path.join(os.path.realpath(tree), "tpu_scale", "__init__.py")
    if os.path.realpath(result["tpu_scale_file"]) != expected:
        raise RuntimeError(f"the child imported {result['tpu_scale_file']}, not {expected}")
    return result


def _views(np, tf):
    """48 non-square views of scikit-learn's two sample photos: (name, format, uint8 array)."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(0)
    views = []
    for long_short in RATIOS:
        for portrait in (False, True):
            for fmt in ("jpeg", "png"):
                for k in range(4):
                    # Long sides from 100 to 600, the ends included, the rest drawn between.
                    long_side = LONG_SIDES[k] if k < 2 else int(rng.integers(*LONG_SIDES))
                    short = max(1, round(long_side * long_short[1] / long_short[0]))
                    height, width = (long_side, short) if portrait else (short, long_side)
                    photo = photos[(k + portrait) % 2]
                    # The largest window of the view's shape in the photo, scaled by 0.5-1.
                    fit = min(photo.shape[0] / height, photo.shape[1] / width)
                    scale = fit * rng.uniform(0.5, 1.0)
                    window_h, window_w = round(height * scale), round(width * scale)
                    top = int(rng.integers(photo.shape[0] - window_h + 1))
                    left = int(rng.integers(photo.shape[1] - window_w + 1))
                    window = photo[top : top + window_h, left : left + window_w]
                    view = tf.image.resize(window, (height, width), antialias=True).numpy()
                    view = np.clip(np.round(view), 0, 255).astype(np.uint8)
                    name = f"{long_short[0]}x{long_short[1]}_{'portrait' if portrait else 'landscape'}_{k}"
                    views.append((name, fmt, view))
    return views


def make_identical_data(directory):
    """The views as files in class folders, then as records two ways: `data.write_tfrecords`
    (converted: PNGs re-encoded as JPEGs) and each file's bytes as they are (as_is). Returns
    {set: pattern} and a description."""
    import numpy as np
    import tensorflow as tf

    from tpu_scale.data import write_tfrecords
    from tpu_scale.data.schema import make_example, write_label_map

    images_dir = os.path.join(directory, "images")
    classes = [f"{a}x{b}" for a, b in RATIOS]
    files = []
    for name, fmt, view in _views(np, tf):
        folder = os.path.join(images_dir, name.split("_")[0])
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"{name}.{'jpg' if fmt == 'jpeg' else 'png'}")
        encoded = tf.io.encode_jpeg(view, quality=90) if fmt == "jpeg" else tf.io.encode_png(view)
        tf.io.write_file(path, encoded)
        files.append((path, fmt, view.shape[:2]))
    converted = os.path.join(directory, "converted")
    write_tfrecords(images_dir, converted, num_shards=2, validation_fraction=0.0, seed=0)

    as_is = os.path.join(directory, "as_is")
    os.makedirs(as_is)
    shards = [os.path.join(as_is, f"train-{i:05d}-of-00002") for i in range(2)]
    writers = [tf.io.TFRecordWriter(shard) for shard in shards]
    for index, (path, _, (height, width)) in enumerate(files):
        with open(path, "rb") as f:
            data = f.read()
        label = classes.index(os.path.basename(os.path.dirname(path))) + 1
        example = make_example(data, label, height=height, width=width)
        writers[index % 2].write(example.SerializeToString())
    for writer in writers:
        writer.close()
    counts = {os.path.basename(s): len(range(i, len(files), 2)) for i, s in enumerate(shards)}
    write_label_map(as_is, classes, 1, {"train": len(files)}, None, counts)

    shapes = sorted({f"{w}x{h}" for _, _, (h, w) in files})
    description = {
        "views": len(files),
        "jpeg": sum(fmt == "jpeg" for _, fmt, _ in files),
        "png": sum(fmt == "png" for _, fmt, _ in files),
        "aspect_ratios": [f"{a}:{b}" for a, b in RATIOS] + [f"{b}:{a}" for a, b in RATIOS],
        "shapes_wxh": shapes,
        "sets": {
            "converted": "data.write_tfrecords (PNGs re-encoded as JPEGs)",
            "as_is": "each file's bytes as they are (PNGs kept)",
        },
    }
    patterns = {name: os.path.join(directory, name, "train-*") for name in ("converted", "as_is")}
    return patterns, description


def identical_readings(patterns, views):
    """Every reading of part identical: set x split x dtype x size x scaled decode at the ImageNet
    level, and the control (the "none" level's evaluation)."""
    readings = []
    for records, pattern in patterns.items():
        for is_training in (True, False):
            for dtype in ("uint8", "float32"):
                for size in (32, 224):
                    for scaled in (False, True):
                        split = "train" if is_training else "eval"
                        readings.append(
                            dict(
                                name=f"{records}/{split}/{dtype}/{size}/"
                                + ("scaled" if scaled else "full"),
                                pattern=pattern,
                                level="imagenet",
                                is_training=is_training,
                                dtype=dtype,
                                image_size=size,
                                scaled_decode=scaled,
                                batch_size=8,
                                batches=2 * views // 8,  # two epochs
                            )
                        )
    control = dict(readings[0], level="none", is_training=False, dtype="uint8", image_size=224)
    control.update(name="control/none/eval/uint8/224/full", scaled_decode=False)
    return readings + [control]


def part_identical(args):
    import numpy as np

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="tpu_scale_aspect_data_") as directory:
        patterns, data = make_identical_data(directory)
        readings = identical_readings(patterns, data["views"])
        results, arrays = {}, {}
        with BeforeTree(args.before_rev) as before:
            for tree_name, tree in (("before", before.path), ("now", ROOT)):
                path = os.path.join(directory, f"{tree_name}.npz")
                results[tree_name] = run_in(
                    tree, {"kind": "read", "readings": readings, "arrays": path}
                )
                arrays[tree_name] = np.load(path)
                print(f"read {len(readings)} readings with {results[tree_name]['tpu_scale_file']}")
            commit = before.commit
        comparisons = {}
        for reading in readings:
            name = reading["name"]
            a = {k: arrays["before"][f"{name}/{k}"] for k in ("images", "labels")}
            b = {k: arrays["now"][f"{name}/{k}"] for k in ("images", "labels")}
            comparisons[name] = {
                "shape": list(b["images"].shape),
                "dtype": str(b["images"].dtype),
                "images_equal": bool(np.array_equal(a["images"], b["images"])),
                "labels_equal": bool(np.array_equal(a["labels"], b["labels"])),
            }
            if not comparisons[name]["images_equal"] and a["images"].shape == b["images"].shape:
                differ = np.any(a["images"] != b["images"], axis=(1, 2, 3))
                comparisons[name]["images_differing"] = int(differ.sum())
            print(f"{name:40s} {comparisons[name]}")
    imagenet = {k: v for k, v in comparisons.items() if not k.startswith("control/")}
    control = {k: v for k, v in comparisons.items() if k.startswith("control/")}
    all_equal = all(c["images_equal"] and c["labels_equal"] for c in imagenet.values())
    control_differs = not any(c["images_equal"] for c in control.values())
    print(f"ImageNet level identical to {args.before_rev} in {len(imagenet)} readings: {all_equal}")
    print(f'control ("none" evaluation, whole image now) differs: {control_differs}')
    return {
        "command": "python benchmarks/aspect_ratio.py --part identical"
        + (f" --before_rev {args.before_rev}" if args.before_rev != BEFORE_REV else ""),
        "before": {"rev": args.before_rev, "commit": commit},
        "now": this_checkout(),
        "tpu_scale_imported": {k: r["tpu_scale_file"] for k, r in results.items()},
        "configs": {k: r["configs"] for k, r in results.items()},
        # The fields of the ImageNet level's config that only one tree has.
        "config_fields_of_one_tree": sorted(
            set(results["now"]["configs"]["imagenet"])
            ^ set(results["before"]["configs"]["imagenet"])
        ),
        "data": data,
        "imagenet_level_identical": all_equal,
        "readings_compared": len(imagenet),
        "control_none_level_differs": control_differs,
        "comparisons": comparisons,
        "seconds": round(time.time() - started, 1),
    }


def make_small_records(directory, num_images, num_shards=8, seed=0):
    """Views of photos of about 60x45 (`SMALL_SHAPES`) as JPEG records with `labels.json`, once
    per folder; their pattern."""
    import numpy as np
    import tensorflow as tf
    from input_data import _photo_crops

    from tpu_scale.data.schema import make_example, write_label_map

    pattern = os.path.join(directory, "train-*")
    if os.path.exists(os.path.join(directory, "DONE")):
        return pattern
    os.makedirs(directory, exist_ok=True)
    photos = _photo_crops(np.random.default_rng(seed), SMALL_SHAPES)
    names = [f"train-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)]
    writers = [tf.io.TFRecordWriter(os.path.join(directory, n)) for n in names]
    for index in range(num_images):
        pixels = next(photos)
        jpeg = tf.io.encode_jpeg(pixels, quality=90).numpy()
        example = make_example(jpeg, 1 + index % 10, height=pixels.shape[0], width=pixels.shape[1])
        writers[index % num_shards].write(example.SerializeToString())
    for writer in writers:
        writer.close()
    counts = {n: len(range(i, num_images, num_shards)) for i, n in enumerate(names)}
    write_label_map(
        directory, [f"class_{i}" for i in range(10)], 1, {"train": num_images}, None, counts
    )
    open(os.path.join(directory, "DONE"), "w").close()
    return pattern


def time_readings(photos_pattern, small_pattern, quick):
    """The four timed readings of every contender: training and evaluation at 224 on ~500x375
    photos and at 32 on ~60x45 views."""
    scale = 4 if quick else 1
    return [
        dict(name="train_224", pattern=photos_pattern, is_training=True, image_size=224,
             batch_size=64, warmup_batches=8, batches=48 // scale),
        dict(name="eval_224", pattern=photos_pattern, is_training=False, image_size=224,
             batch_size=64, warmup_batches=8, batches=48 // scale),
        dict(name="train_32", pattern=small_pattern, is_training=True, image_size=32,
             batch_size=256, warmup_batches=8, batches=80 // scale),
        dict(name="eval_32", pattern=small_pattern, is_training=False, image_size=32,
             batch_size=256, warmup_batches=8, batches=80 // scale),
    ]  # fmt: skip


def part_time(args):
    from common import spread, summarize
    from input_data import generate_records

    started = time.time()
    num_photos, num_small = (256, 1024) if args.quick else (512, 4096)
    photos = generate_records(
        f"/tmp/tpu_scale_input_bench_{num_photos}_photos", num_photos, 8, images="photos"
    )
    small = make_small_records(f"/tmp/tpu_scale_aspect_small_{num_small}", num_small)
    readings = time_readings(photos["pattern"], small, args.quick)
    names = list(CONTENDERS)
    rounds = {name: [] for name in names}
    with BeforeTree(args.before_rev) as before:
        trees = {"before": before.path, "now": ROOT}
        commit = before.commit
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                tree, level, aspect_ratio = CONTENDERS[name]
                spec = {"kind": "time", "level": level, "aspect_ratio": aspect_ratio}
                result = run_in(trees[tree], dict(spec, readings=readings))
                rounds[name].append(result)
                print(
                    f"round {r + 1}/{args.rounds} {name:17s} "
                    + "  ".join(
                        f"{x['name']} {result[x['name']]['images_per_second']:6.0f}/s "
                        f"{result[x['name']]['cpu_ms_per_image']:.3f} ms"
                        for x in readings
                    ),
                    flush=True,
                )
    contenders = {}
    for name in names:
        tree, level, aspect_ratio = CONTENDERS[name]
        entry = {
            "tree": f"{args.before_rev} ({commit[:12]})" if tree == "before" else "this checkout",
            "level": level,
            "aspect_ratio": rounds[name][0]["aspect_ratio"] or "(no field: centred square)",
        }
        baseline = BASELINE_OF.get(name)
        for reading in (x["name"] for x in readings):
            figures = {}
            for key in ("images_per_second", "cpu_ms_per_image"):
                values = [result[reading][key] for result in rounds[name]]
                base = [result[reading][key] for result in rounds[baseline]] if baseline else None
                figures[key] = summarize(values, base)
                if baseline:
                    figures[key]["ratio_per_round"] = spread([v / b for v, b in zip(values, base)])
            entry[reading] = figures
        if baseline:
            entry["against"] = baseline
        contenders[name] = entry
    print(markdown_table(contenders, [x["name"] for x in readings]))
    return {
        "command": "flock /tmp/tpu_scale_timing.lock nice -n 5 python benchmarks/aspect_ratio.py "
        "--part time"
        + (f" --rounds {args.rounds}" if args.rounds != 5 else "")
        + (" --quick" if args.quick else ""),
        "before": {"rev": args.before_rev, "commit": commit},
        "now": this_checkout(),
        "data": {
            "224": dict(photos, note="views of photos, mostly 500x375, JPEG quality 90"),
            "32": {
                "pattern": small,
                "num_images": num_small,
                "shapes_hxw": sorted(set(SMALL_SHAPES)),
                "note": "views of photos, mostly 60x45, JPEG quality 90",
            },
        },
        "readings": readings,
        "rounds": args.rounds,
        "dtype": "uint8",
        "contenders": contenders,
        "rounds_raw": rounds,
        "seconds": round(time.time() - started, 1),
    }


def markdown_table(contenders, readings):
    """Per reading and contender: images/s and CPU ms per image, median [min, max], and the ratio
    of the medians to today's."""
    lines = [
        "| reading | contender | images/s | / today | CPU ms/image | / today |",
        "|---|---|---|---|---|---|",
    ]
    for reading in readings:
        for name, entry in contenders.items():
            rate, cpu = entry[reading]["images_per_second"], entry[reading]["cpu_ms_per_image"]
            lines.append(
                f"| {reading} | {name} | {rate['median']:.0f} [{rate['min']:.0f}, "
                f"{rate['max']:.0f}] | {rate.get('ratio', 1.0):.3f} | {cpu['median']:.3f} "
                f"[{cpu['min']:.3f}, {cpu['max']:.3f}] | {cpu.get('ratio', 1.0):.3f} |"
            )
    return "\n".join(lines)


def holds_timing_lock():
    """Whether this process runs under `flock TIMING_LOCK ...`: it holds an open file of the lock
    (flock passes its descriptor on) and the lock is taken."""
    import fcntl

    lock = os.path.realpath(TIMING_LOCK)
    inherited = False
    for fd in os.listdir("/proc/self/fd"):
        try:
            inherited |= os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")) == lock
        except OSError:
            pass
    try:
        with open(TIMING_LOCK, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except BlockingIOError:
        return inherited


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--_child":
        return child_main(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("identical", "time"), required=True)
    parser.add_argument("--before_rev", default=BEFORE_REV, help="today's package (a commit)")
    parser.add_argument("--rounds", type=int, default=5, help="part time: interleaved rounds")
    parser.add_argument("--quick", action="store_true", help="part time: less data and reading")
    args = parser.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from common import machine_info

    if args.part == "time" and not holds_timing_lock():
        raise SystemExit(f"time under the machine's timing lock: flock {TIMING_LOCK} nice -n 5 ...")
    result = part_identical(args) if args.part == "identical" else part_time(args)
    result["machine"] = machine_info()
    out = {}
    if os.path.exists(RESULT_PATH):
        with open(RESULT_PATH) as f:
            out = json.load(f)
    out[args.part] = result
    os.makedirs(os.path.dirname(RESULT_PATH), exist_ok=True)
    with open(RESULT_PATH, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {RESULT_PATH} ({args.part}) in {result['seconds']} s")


if __name__ == "__main__":
    main()
