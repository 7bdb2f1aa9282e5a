"""Input pipeline throughput: `ImageNetInput` against the decode limit and two other pipelines.

On generated ImageNet-like JPEG TFRecords (about 500x375, quality 90, about 100 KB each, multi-scale
noise so the files compress like photographs), with the `labels.json` that `write_tfrecords` puts
beside its shards (each file's record count among its contents), in one run, images per second of:

  ours          `tpu_scale.data.ImageNetInput(..., is_training=True)`: the full training path
                (fused decode-and-crop, resize, flip, normalize, batch), default options.
  ours_uint8_classic
                the uint8 path on the same files without `labels.json`, as the classic ImageNet
                conversion leaves them: the reader then adds up each file's bytes to find a file
                that stops early, instead of comparing its record count.
  tfm           tf-models-official's ImageNet classification input (`classification_input.Decoder`
                and `Parser` under its `InputReader`, as its image classification task builds them)
                on the same files; it pins its own TensorFlow, so it runs with another environment's
                python (`--tfm_python`, or the TFM_PYTHON environment variable).
  naive         sequential read, full JPEG decode, resize to 224, flip, normalize, batch; no
                parallelism.
  decode_limit  the host's ceiling: cores x the one-core rate of decode-and-crop alone (JPEG
                header, Inception window, `decode_and_crop_jpeg`; no resize, no tf.data), measured
                pinned to one core.
  floor         the required host work of the uint8 path and nothing else: the same loop with
                resize and flip added, pinned to one core (the floor of the uint8 target).

And, like for like with the floor, CPU milliseconds per image of:

  ours_uint8_one_core  the uint8 training path pinned to one core, with one tf.data thread and one
                       thread in each of TensorFlow's op pools: the floor's conditions.
  floor_every_core     the floor loop on every core at once (one process per core): what the same
                       kernels cost when all cores work, as they do under the full pipeline.
  paired               `ours_uint8_one_core` and `floor` at the same time, each pinned to its own
                       core (cores and starting order swapped every round), their timed windows
                       started together: a load from other users of the machine lifts both alike,
                       so each pair of windows gives one ratio, and the ratios' median and spread
                       answer "within 1.1x of the floor" where the medians of runs minutes apart
                       are too noisy to.

Each pipeline runs in its own process (own thread pools, own peak RSS), in interleaved rounds so
that load from other users of the machine hits every pipeline alike; each process times several
windows after a warm-up. Figures are medians over all windows, with min-max.

`--checks` measures only what skipping bad records costs: `ours_uint8_one_core` (bad records
skipped, named and counted, the default) and the same uint8 training path as the pipeline was
before bad records were skipped (`--baseline_rev`, the code of that commit loaded from git: one
assertion per 128 records, decode fused with the batching), at the same time, each pinned to its own
core, cores and starting order swapped every round: the median, min and max of the windows' CPU
ratios. Writes `benchmarks/results/input_pipeline_checks.json`.

`--images photos` runs the same on views of real photographs (scikit-learn's two sample photos, cut
into ImageNet-sized windows, rescaled, mirrored, JPEG quality 90) instead of the generated images.

Usage:
    python benchmarks/input_pipeline.py [--quick] [--tfm_python /path/to/venv/bin/python] \
        [--images photos] [--checks [--baseline_rev REV]]

Writes `benchmarks/results/input_pipeline.json` (`input_pipeline_photos.json` with photos).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from common import HERE, RESULTS, machine_info  # noqa: E402

ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)  # runnable from a checkout without installing, as the workers are
IMAGE_SIZE = 224
PIPELINES = ("ours", "tfm", "naive", "decode_limit")

# --------------------------------------------------------------------------- data


def _natural_image(rng, height, width):
    """Smooth structure at several scales plus fine texture: compresses like a photograph."""
    import numpy as np
    import tensorflow as tf

    image = np.zeros((height, width, 3), np.float32)
    for cells, amplitude in ((4, 60.0), (16, 35.0), (64, 20.0), (160, 12.0)):
        coarse = rng.normal(size=(max(2, height * cells // 375), max(2, width * cells // 500), 3))
        image += (
            amplitude
            * tf.image.resize(coarse[None].astype(np.float32), (height, width), "bicubic")[0]
        )
    image += rng.normal(size=(height, width, 3)).astype(np.float32) * 16.0
    image += rng.uniform(60, 190, size=3).astype(np.float32)
    return np.clip(image, 0, 255).astype(np.uint8)


def _photo_crops(rng, shapes):
    """Real photographs (scikit-learn's two sample photos, 427x640) cut into ImageNet-sized views:
    a random window of each shape, resized by up to 20% either way and maybe mirrored, so that no
    two images are alike. Yields uint8 arrays."""
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    while True:
        photo = photos[rng.integers(len(photos))]
        height, width = shapes[rng.integers(len(shapes))]
        scale = rng.uniform(0.8, 1.2)
        # A window of the photo that, resized by `scale`, gives (height, width) (capped to fit).
        window_h = min(photo.shape[0], round(height / scale))
        window_w = min(photo.shape[1], round(width / scale))
        top = rng.integers(photo.shape[0] - window_h + 1)
        left = rng.integers(photo.shape[1] - window_w + 1)
        view = photo[top : top + window_h, left : left + window_w]
        view = tf.image.resize(view, (height, width), antialias=True).numpy()
        if rng.integers(2):
            view = view[:, ::-1]
        yield np.clip(np.round(view), 0, 255).astype(np.uint8)


def generate_records(directory, num_images, num_shards, seed=0, images="noise"):
    """Writes `num_images` ImageNet-like JPEGs as classic-layout TFRecords (once; reused).

    Args:
      images: "noise" (generated multi-scale noise that compresses like a photograph) or "photos"
        (views of real photographs, `_photo_crops`).
    """
    import numpy as np
    import tensorflow as tf

    from tpu_scale.data.schema import make_example

    done = os.path.join(directory, "DONE")
    if os.path.exists(done):
        with open(done) as f:
            info = json.load(f)
        return _with_label_map(directory, info)
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    # Mostly landscape 500x375, as in ImageNet; some portrait and other aspect ratios.
    shapes = [(375, 500)] * 6 + [(500, 375), (333, 500), (400, 500), (375, 450)]
    photos = _photo_crops(rng, shapes) if images == "photos" else None
    sizes = []
    writers = [
        tf.io.TFRecordWriter(os.path.join(directory, f"train-{i:05d}-of-{num_shards:05d}"))
        for i in range(num_shards)
    ]
    for index in range(num_images):
        if photos is None:
            height, width = shapes[rng.integers(len(shapes))]
            pixels = _natural_image(rng, height, width)
        else:
            pixels = next(photos)
            height, width = pixels.shape[:2]
        jpeg = tf.io.encode_jpeg(pixels, quality=90).numpy()
        sizes.append(len(jpeg))
        example = make_example(jpeg, 1 + index % 1000, height=height, width=width)
        writers[index % num_shards].write(example.SerializeToString())
    for writer in writers:
        writer.close()
    info = {
        "pattern": os.path.join(directory, "train-*"),
        "num_images": num_images,
        "num_shards": num_shards,
        "mean_jpeg_kb": round(sum(sizes) / len(sizes) / 1000, 1),
        "quality": 90,
        "images": images,
    }
    with open(done, "w") as f:
        json.dump(info, f)
    return _with_label_map(directory, info)


def _with_label_map(directory, info):
    """Adds what `write_tfrecords` writes beside its shards (`labels.json`, with each file's record
    count) and a `classic/` folder that links the same shards without it, as the classic ImageNet
    conversion leaves them (the reader then counts each file's bytes). Returns `info` with the
    pattern of the classic files."""
    from tpu_scale.data.schema import LABEL_MAP_FILE, write_label_map

    num_images, num_shards = info["num_images"], info["num_shards"]
    names = [f"train-{i:05d}-of-{num_shards:05d}" for i in range(num_shards)]
    if not os.path.exists(os.path.join(directory, LABEL_MAP_FILE)):
        # Example i went to shard i % num_shards.
        counts = {name: len(range(i, num_images, num_shards)) for i, name in enumerate(names)}
        write_label_map(
            directory, [f"class_{i}" for i in range(1000)], 1, {"train": num_images}, None, counts
        )
    classic = os.path.join(directory, "classic")
    os.makedirs(classic, exist_ok=True)
    for name in names:
        if not os.path.lexists(os.path.join(classic, name)):
            os.symlink(os.path.join(directory, name), os.path.join(classic, name))
    return dict(info, classic_pattern=os.path.join(classic, "train-*"))


# --------------------------------------------------------------------------- workers (one per
# process)


def _wait_for_peers(barrier):
    """Waits until every process of `barrier` ("directory:count") has reached it."""
    directory, count = barrier.rsplit(":", 1)
    open(os.path.join(directory, str(os.getpid())), "w").close()
    deadline = time.time() + 600
    while len(os.listdir(directory)) < int(count):
        if time.time() > deadline:
            raise RuntimeError(f"the other processes of {barrier} never started")
        time.sleep(0.01)


def _time_windows(next_batch, batch_size, warmup_seconds, window_seconds, windows, barrier=None):
    """Images/s and CPU milliseconds per image over `windows` timed windows, after a warm-up; with
    a `barrier`, the warm-up starts when every process of it is ready."""
    if barrier:
        _wait_for_peers(barrier)
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_seconds:
        next_batch()
    rates, cpu_ms = [], []
    for _ in range(windows):
        count, start, cpu_start = 0, time.perf_counter(), time.process_time()
        while time.perf_counter() - start < window_seconds:
            next_batch()
            count += batch_size
        rates.append(count / (time.perf_counter() - start))
        cpu_ms.append(1000 * (time.process_time() - cpu_start) / count)
    return rates, cpu_ms


def _iterate(dataset):
    iterator = iter(dataset)
    return lambda: next(iterator)


def _pin_to_one_core(core):
    """This process and every thread it starts from now on run on `core` alone, TensorFlow's op
    pools with one thread each."""
    os.sched_setaffinity(0, {core})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


# The pipeline before bad records were skipped: it failed at the first one.
BASELINE_REV = "ebd1ce2"


def _baseline_input_class(rev):
    """`ImageNetInput` as it was at commit `rev`: its input_pipeline, sources and image_ops modules
    read from git into a package of their own (the rest of `tpu_scale.data` is shared)."""
    import importlib

    package = os.path.join(tempfile.mkdtemp(), "baseline_data")
    os.makedirs(package)
    open(os.path.join(package, "__init__.py"), "w").close()
    for module in ("input_pipeline", "sources", "image_ops"):
        text = subprocess.run(
            ["git", "-C", ROOT, "show", f"{rev}:tpu_scale/data/{module}.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        text = text.replace(
            "from tpu_scale.data import image_ops, sources",
            "from baseline_data import image_ops, sources",
        ).replace("from tpu_scale.data.sources import", "from baseline_data.sources import")
        with open(os.path.join(package, f"{module}.py"), "w") as f:
            f.write(text)
    sys.path.insert(0, os.path.dirname(package))
    return importlib.import_module("baseline_data.input_pipeline").ImageNetInput


def worker_ours(args, dtype="float32", one_core=False, baseline=False):
    if one_core:
        _pin_to_one_core(args.core)
    if baseline:
        ImageNetInput = _baseline_input_class(args.baseline_rev)
    else:
        from tpu_scale.data import ImageNetInput

    inp = ImageNetInput(
        args.pattern,
        is_training=True,
        global_batch_size=args.batch_size,
        image_size=IMAGE_SIZE,
        dtype=dtype,
        threadpool_size=1 if one_core else None,
    )
    return _time_windows(
        _iterate(inp.dataset()),
        args.batch_size,
        args.warmup,
        args.window,
        args.windows,
        args.barrier,
    )


def worker_naive(args):
    import tensorflow as tf

    from tpu_scale.data import image_ops

    def parse_and_decode(serialized):
        features = tf.io.parse_single_example(
            serialized,
            {
                "image/encoded": tf.io.FixedLenFeature([], tf.string),
                "image/class/label": tf.io.FixedLenFeature([], tf.int64),
            },
        )
        image = tf.io.decode_jpeg(features["image/encoded"], channels=3)
        image = tf.image.resize(image, [IMAGE_SIZE, IMAGE_SIZE])
        image = tf.image.random_flip_left_right(image)
        return image_ops.normalize_image(image), tf.cast(
            features["image/class/label"] - 1, tf.int32
        )

    files = sorted(tf.io.gfile.glob(args.pattern))
    dataset = tf.data.TFRecordDataset(files).repeat().map(parse_and_decode).batch(args.batch_size)
    return _time_windows(_iterate(dataset), args.batch_size, args.warmup, args.window, args.windows)


def _kernel_loops(args):
    """Graph loops over 256 in-memory JPEGs of the files, one image after another, running only
    TensorFlow's kernels for a piece of the per-image work (no tf.data): {name: next_chunk}."""
    import tensorflow as tf

    from tpu_scale.data import image_ops

    jpegs = []
    for record in tf.data.TFRecordDataset(sorted(tf.io.gfile.glob(args.pattern))).take(256):
        example = tf.train.Example.FromString(record.numpy())
        jpegs.append(example.features.feature["image/encoded"].bytes_list.value[0])
    jpegs = tf.constant(jpegs)
    chunk = args.batch_size

    def decode_and_crop(image_bytes, seed):
        shape = tf.image.extract_jpeg_shape(image_bytes)
        window = image_ops.sample_crop_window(shape[0], shape[1], seed)
        return tf.image.decode_and_crop_jpeg(image_bytes, window, channels=3)

    work = {
        "decode_and_crop": decode_and_crop,
        "+resize_flip": lambda b, seed: image_ops.decode_and_random_crop(b, IMAGE_SIZE, seed),
        "+normalize": lambda b, seed: image_ops.normalize_image(
            image_ops.decode_and_random_crop(b, IMAGE_SIZE, seed)
        ),
    }

    def loop_over(per_image):
        @tf.function
        def run_chunk(step):
            indices = (tf.range(chunk) + step * chunk) % tf.shape(jpegs)[0]
            seeds = tf.stack(
                [tf.cast(indices, tf.int64), tf.fill([chunk], tf.cast(step, tf.int64))], axis=1
            )
            # Reading one value keeps each image's work alive without adding any.
            return tf.map_fn(
                lambda inputs: tf.cast(per_image(*inputs)[0, 0, 0], tf.float32),
                (tf.gather(jpegs, indices), seeds),
                fn_output_signature=tf.float32,
                parallel_iterations=1,
            )

        step = tf.Variable(0)

        def next_chunk():
            step.assign_add(1)
            run_chunk(step).numpy()

        return next_chunk

    return {name: loop_over(per_image) for name, per_image in work.items()}


def worker_decode_one_core(args):
    """Decode-and-crop alone, pinned to one core, one TF thread, a graph loop over in-memory JPEGs.

    Also times, once each, the same loop with the rest of our per-image work added (resize and flip,
    then normalization), to show where a pipeline's time goes beyond the decode.
    """
    _pin_to_one_core(args.core)
    loops = _kernel_loops(args)
    chunk = args.batch_size
    rates, cpu_ms = _time_windows(
        loops["decode_and_crop"], chunk, args.warmup, args.window, args.windows
    )
    breakdown = {"decode_and_crop": statistics.median(cpu_ms)}
    for name in ("+resize_flip", "+normalize"):
        _, extra_cpu_ms = _time_windows(loops[name], chunk, 1.0, args.window, 1)
        breakdown[name] = extra_cpu_ms[0]
    return rates, cpu_ms, {"cpu_ms_per_image_breakdown": breakdown}


def worker_floor(args):
    """The floor alone, fully timed: decode-and-crop + resize + flip, pinned to one core.

    Run once by itself, and twice at once (one process per core) for the floor of a host whose
    cores all work: what the same kernels cost when they share the caches and memory.
    """
    _pin_to_one_core(args.core)
    return _time_windows(
        _kernel_loops(args)["+resize_flip"],
        args.batch_size,
        args.warmup,
        args.window,
        args.windows,
        args.barrier,
    )


def worker_tfm(args):
    """tf-models-official's classification input, built as its classification task builds it."""
    from official.common import dataset_fn
    from official.vision.configs import image_classification as classification_config
    from official.vision.dataloaders import classification_input, input_reader_factory

    params = classification_config.DataConfig(
        input_path=args.pattern,
        global_batch_size=args.batch_size,
        is_training=True,
        dtype="float32",
        # The same shuffle buffer as ours (its default is 10000), so memory figures compare like for
        # like.
        shuffle_buffer_size=1024,
    )
    decoder = classification_input.Decoder(
        image_field_key=params.image_field_key, label_field_key=params.label_field_key
    )
    parser = classification_input.Parser(
        output_size=[IMAGE_SIZE, IMAGE_SIZE],
        num_classes=1001,
        image_field_key=params.image_field_key,
        label_field_key=params.label_field_key,
        decode_jpeg_only=params.decode_jpeg_only,
        aug_rand_hflip=params.aug_rand_hflip,
        aug_crop=params.aug_crop,
        dtype=params.dtype,
        center_crop_fraction=params.center_crop_fraction,
        tf_resize_method=params.tf_resize_method,
    )
    reader = input_reader_factory.input_reader_generator(
        params,
        dataset_fn=dataset_fn.pick_dataset_fn(params.file_type),
        decoder_fn=decoder.decode,
        parser_fn=parser.parse_fn(params.is_training),
    )
    return _time_windows(
        _iterate(reader.read()), args.batch_size, args.warmup, args.window, args.windows
    )


# Bytes of one output image per dtype: what crosses from the host to the accelerator.
OUTPUT_BYTES = {"float32": 4, "bfloat16": 2, "uint8": 1}

WORKERS = {
    "ours": worker_ours,
    "ours_bfloat16": lambda args: worker_ours(args, "bfloat16"),
    "ours_uint8": lambda args: worker_ours(args, "uint8"),
    "ours_uint8_one_core": lambda args: worker_ours(args, "uint8", one_core=True),
    "baseline_uint8_one_core": lambda args: worker_ours(
        args, "uint8", one_core=True, baseline=True
    ),
    "baseline_uint8": lambda args: worker_ours(args, "uint8", baseline=True),
    "floor": worker_floor,
    "naive": worker_naive,
    "decode_one_core": worker_decode_one_core,
    "tfm": worker_tfm,
}


def run_worker(args):
    rates, cpu_ms, *extra = WORKERS[args.worker](args)
    import tensorflow as tf

    result = {
        **(extra[0] if extra else {}),
        "images_per_second": rates,
        "cpu_ms_per_image": cpu_ms,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "tensorflow": tf.__version__,
    }
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- driver


def _command(python, worker, info, args, **extra):
    command = [python, os.path.abspath(__file__), "--worker", worker, "--pattern", info["pattern"]]
    for key in ("batch_size", "warmup", "window", "windows"):
        command += [f"--{key}", str(getattr(args, key))]
    for key, value in extra.items():
        command += [f"--{key}", str(value)]
    if worker.startswith("baseline"):
        command += ["--baseline_rev", args.baseline_rev]
    return command


def _result_of(worker, returncode, stdout, stderr):
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = "\n".join((stderr or stdout).strip().splitlines()[-12:])
    raise RuntimeError(f"{worker} worker failed (exit {returncode}):\n{tail}")


_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)


def _spawn(python, worker, info, args, **extra):
    command = _command(python, worker, info, args, **extra)
    completed = subprocess.run(command, capture_output=True, text=True, env=_ENV, timeout=900)
    return _result_of(worker, completed.returncode, completed.stdout, completed.stderr)


def _spawn_on_every_core(worker, info, args, cores):
    """One `worker` process per core, all at once; their results merged (windows pooled)."""
    results = _spawn_at_once([(worker, core) for core in range(cores)], info, args)
    merged = {
        key: sum((r[key] for r in results), []) for key in ("images_per_second", "cpu_ms_per_image")
    }
    merged["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    merged["tensorflow"] = results[0]["tensorflow"]
    return merged


def _spawn_at_once(jobs, info, args):
    """Runs `jobs` ((worker, core) pairs) at the same time, their timed windows started together;
    their results, in order."""
    with tempfile.TemporaryDirectory() as barrier:
        procs = [
            subprocess.Popen(
                _command(
                    sys.executable, worker, info, args, core=core, barrier=f"{barrier}:{len(jobs)}"
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=_ENV,
            )
            for worker, core in jobs
        ]
        results = []
        for (worker, _), proc in zip(jobs, procs):
            stdout, stderr = proc.communicate(timeout=900)
            results.append(_result_of(worker, proc.returncode, stdout, stderr))
    return results


def _summary(rates):
    return {
        "median": round(statistics.median(rates), 1),
        "min": round(min(rates), 1),
        "max": round(max(rates), 1),
        "samples": len(rates),
    }


def markdown_table(result):
    """The results as the Markdown table of `benchmarks/README.md`."""
    pipelines = result["pipelines"]
    labels = {
        "ours": "ours: `ImageNetInput` training path",
        "ours_bfloat16": "ours, dtype='bfloat16'",
        "ours_uint8": "ours, dtype='uint8' (normalized on the device)",
        "ours_uint8_classic": "ours, dtype='uint8', classic files (no labels.json: bytes counted)",
        "tfm": "tf-models-official classification input",
        "naive": "naive: sequential read, full decode, resize",
        "decode_limit": f"decode limit: {pipelines['decode_limit']['cores']} cores x one-core "
        "decode-and-crop",
    }
    lines = [
        "| pipeline | images/s, median (min-max) | CPU ms / image | peak RSS MB | ours / this "
        "(images/s) "
        "| ours / this (CPU time) |",
        "|---|---|---|---|---|---|",
    ]
    for name in (
        "ours",
        "ours_bfloat16",
        "ours_uint8",
        "ours_uint8_classic",
        "tfm",
        "naive",
        "decode_limit",
    ):
        entry = pipelines[name]
        if "skipped" in entry:
            lines.append(f"| {labels[name]} | skipped: {entry['skipped']} | | | | |")
            continue
        cpu = entry.get("cpu_ms_per_image", entry.get("one_core", {}).get("cpu_ms_per_image"))
        if name == "decode_limit":
            cpu = f"{cpu:.2f} (one core)"
        else:
            cpu = f"{cpu:.2f}"
        rss = entry.get("peak_rss_mb", entry.get("one_core", {}).get("peak_rss_mb"))
        ratio = result["ratios"].get(f"ours/{name}")
        cpu_ratio = result["ratios_by_cpu_time"].get(f"ours/{name}")
        lines.append(
            f"| {labels[name]} | {entry['median']:.0f} ({entry['min']:.0f}-{entry['max']:.0f}) | "
            f"{cpu} | {rss} "
            f"| {'' if ratio is None else f'{ratio:.2f}'} "
            f"| {'' if cpu_ratio is None else f'{cpu_ratio:.2f}'} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer images, rounds and windows (2-3 minutes)"
    )
    parser.add_argument(
        "--tfm_python",
        default=os.environ.get("TFM_PYTHON"),
        help="python of an environment with tf-models-official (default: $TFM_PYTHON)",
    )
    parser.add_argument("--data_dir", default=None, help="where the generated TFRecords are kept")
    parser.add_argument(
        "--images",
        choices=("noise", "photos"),
        default="noise",
        help="generated noise that compresses like photographs, or views of real photographs "
        "(scikit-learn's sample images)",
    )
    parser.add_argument(
        "--output", help="default: benchmarks/results/input_pipeline.json (_photos with photos)"
    )
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument(
        "--checks",
        action="store_true",
        help="only the cost of skipping bad records: the uint8 path against --baseline_rev's, "
        "paired on one core each",
    )
    parser.add_argument(
        "--baseline_rev",
        default=BASELINE_REV,
        help="the commit whose pipeline --checks compares with (default: the last one that failed "
        "at the first bad record)",
    )
    # Worker-process flags.
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--pattern", help=argparse.SUPPRESS)
    parser.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--warmup", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--window", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--windows", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--barrier", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return run_worker(args)

    rounds, args.windows, args.window, args.warmup = (
        (2, 2, 3.0, 2.0) if args.quick else (3, 3, 8.0, 5.0)
    )
    num_images = 256 if args.quick else 1024
    suffix = "" if args.images == "noise" else f"_{args.images}"
    args.output = args.output or os.path.join(RESULTS, f"input_pipeline{suffix}.json")
    data_dir = args.data_dir or os.path.join("/tmp", f"tpu_scale_input_bench_{num_images}{suffix}")
    started = time.time()
    info = generate_records(data_dir, num_images, num_shards=16, images=args.images)
    print(
        f"data: {info['num_images']} JPEGs, mean {info['mean_jpeg_kb']} KB, in {data_dir}",
        flush=True,
    )

    cores = len(os.sched_getaffinity(0))
    if args.checks:
        return measure_checks(args, info, rounds=4 if args.quick else 6, started=started)
    names = ["ours", "ours_bfloat16", "ours_uint8", "ours_uint8_classic", "naive"]
    names += ["decode_one_core"]
    names += ["tfm"] if args.tfm_python else []
    # Like for like: the uint8 path and the floor on one core each, and the floor on every core.
    names += ["ours_uint8_one_core", "floor", "floor_every_core"]
    names += ["paired"] if cores >= 2 else []
    rates = {name: [] for name in names}
    paired = {"uint8_cpu_ms_per_image": [], "floor_cpu_ms_per_image": [], "ratios": []}
    memory = {name: [] for name in names}
    cpu_ms = {name: [] for name in names}
    breakdowns = []
    versions = {}
    for round_index in range(rounds):
        for name in names:
            python = args.tfm_python if name == "tfm" else sys.executable
            pinned = name in ("decode_one_core", "ours_uint8_one_core", "floor")
            extra = {"core": round_index % cores} if pinned else {}
            if name == "paired":
                # Cores and the order of starting swap every round: started second, the same
                # worker measured 4% more CPU per image (the same worker as both of a pair).
                core = round_index % 2
                jobs = [("ours_uint8_one_core", core), ("floor", 1 - core)]
                results = _spawn_at_once(jobs[:: 1 - 2 * core], info, args)
                uint8, floor = results[:: 1 - 2 * core]
                paired["uint8_cpu_ms_per_image"] += uint8["cpu_ms_per_image"]
                paired["floor_cpu_ms_per_image"] += floor["cpu_ms_per_image"]
                window_ratios = [
                    u / f for u, f in zip(uint8["cpu_ms_per_image"], floor["cpu_ms_per_image"])
                ]
                paired["ratios"] += window_ratios
                print(
                    f"round {round_index + 1}/{rounds} paired           uint8 on core {core} / "
                    f"floor on core {1 - core}: " + ", ".join(f"{r:.3f}" for r in window_ratios),
                    flush=True,
                )
                continue
            if name == "floor_every_core":
                result = _spawn_on_every_core("floor", info, args, cores)
            elif name == "ours_uint8_classic":
                classic = dict(info, pattern=info["classic_pattern"])
                result = _spawn(python, "ours_uint8", classic, args)
            else:
                result = _spawn(python, name, info, args, **extra)
            rates[name] += result["images_per_second"]
            memory[name].append(result["peak_rss_mb"])
            cpu_ms[name] += result["cpu_ms_per_image"]
            if "cpu_ms_per_image_breakdown" in result:
                breakdowns.append(result["cpu_ms_per_image_breakdown"])
            versions[name] = result["tensorflow"]
            print(
                f"round {round_index + 1}/{rounds} {name:16s} "
                f"{statistics.median(result['images_per_second']):8.1f} images/s  "
                f"{statistics.median(result['cpu_ms_per_image']):6.2f} CPU ms/image  "
                f"peak RSS {result['peak_rss_mb']:.0f} MB",
                flush=True,
            )

    pipelines = {
        name: dict(
            _summary(rates[name]),
            cpu_ms_per_image=round(statistics.median(cpu_ms[name]), 3),
            peak_rss_mb=round(max(memory[name])),
            tensorflow=versions[name],
        )
        for name in names
        if name != "paired"
    }
    one_core = pipelines.pop("decode_one_core")
    pipelines["decode_limit"] = {
        "median": round(cores * one_core["median"], 1),
        "min": round(cores * one_core["min"], 1),
        "max": round(cores * one_core["max"], 1),
        "one_core": one_core,
        "cores": cores,
    }
    if not args.tfm_python:
        pipelines["tfm"] = {
            "skipped": "no --tfm_python given (tf-models-official needs its own environment)"
        }
    pipelines["decode_limit"]["cpu_ms_per_image_breakdown"] = {
        key: round(statistics.median(b[key] for b in breakdowns), 3) for key in breakdowns[0]
    }
    ours = pipelines["ours"]["median"]
    ratios = {
        "ours/decode_limit": round(ours / pipelines["decode_limit"]["median"], 3),
        "ours/naive": round(ours / pipelines["naive"]["median"], 3),
    }
    if args.tfm_python:
        ratios["ours/tfm"] = round(ours / pipelines["tfm"]["median"], 3)
    # CPU time per image does not depend on how much of the machine other users take: the same
    # ratios as throughput would be on an idle host where every pipeline keeps all cores busy.
    ours_cpu = pipelines["ours"]["cpu_ms_per_image"]
    cpu_ratios = {
        "ours/decode_limit": round(one_core["cpu_ms_per_image"] / ours_cpu, 3),
        "ours/naive": round(pipelines["naive"]["cpu_ms_per_image"] / ours_cpu, 3),
    }
    if args.tfm_python:
        cpu_ratios["ours/tfm"] = round(pipelines["tfm"]["cpu_ms_per_image"] / ours_cpu, 3)
    # The floor of the required host work: decode-and-crop + resize + flip, pinned one-core loop
    # (TensorFlow's own kernels, no tf.data). The uint8 path does exactly that work plus tf.data's.
    # Timed over as many windows as the pipelines (the breakdown's figure is one window).
    floor = pipelines["floor"]["cpu_ms_per_image"]
    output_modes = {
        dtype: {
            "cpu_ms_per_image": pipelines[name]["cpu_ms_per_image"],
            "images_per_second": pipelines[name]["median"],
            "bytes_per_image": IMAGE_SIZE * IMAGE_SIZE * 3 * OUTPUT_BYTES[dtype.split(",")[0]],
            "peak_rss_mb": pipelines[name]["peak_rss_mb"],
            "cpu_over_floor": round(pipelines[name]["cpu_ms_per_image"] / floor, 3),
        }
        for dtype, name in (
            ("float32", "ours"),
            ("bfloat16", "ours_bfloat16"),
            ("uint8", "ours_uint8"),
            ("uint8, classic files", "ours_uint8_classic"),
        )
    }
    if args.tfm_python:
        for name in ("ours_uint8", "ours_uint8_classic"):
            ratios[f"{name}/tfm"] = round(pipelines[name]["median"] / pipelines["tfm"]["median"], 3)
    # The same work measured two ways, to tell tf.data's own cost from what running on every core
    # costs the kernels themselves (shared caches and memory bandwidth, and on a virtual machine
    # its neighbours): the uint8 path pinned to one core against the one-core floor, and on every
    # core against the floor run on every core at once.
    like_for_like = {
        "one_core": {
            "uint8_cpu_ms_per_image": pipelines["ours_uint8_one_core"]["cpu_ms_per_image"],
            "floor_cpu_ms_per_image": floor,
        },
        "every_core": {
            "uint8_cpu_ms_per_image": pipelines["ours_uint8"]["cpu_ms_per_image"],
            "floor_cpu_ms_per_image": pipelines["floor_every_core"]["cpu_ms_per_image"],
        },
    }
    for entry in like_for_like.values():
        entry["ratio"] = round(entry["uint8_cpu_ms_per_image"] / entry["floor_cpu_ms_per_image"], 3)
    if paired["ratios"]:
        like_for_like["paired"] = {
            "uint8_cpu_ms_per_image": round(statistics.median(paired["uint8_cpu_ms_per_image"]), 3),
            "floor_cpu_ms_per_image": round(statistics.median(paired["floor_cpu_ms_per_image"]), 3),
            "ratio": round(statistics.median(paired["ratios"]), 3),
            "ratio_min": round(min(paired["ratios"]), 3),
            "ratio_max": round(max(paired["ratios"]), 3),
            "window_ratios": [round(r, 3) for r in paired["ratios"]],
        }
    targets = {
        "ours/decode_limit >= 0.9": ratios["ours/decode_limit"] >= 0.9,
        "uint8 CPU per image <= 1.1x the floor": output_modes["uint8"]["cpu_over_floor"] <= 1.1,
        "uint8 on one core <= 1.1x the floor on one core": like_for_like["one_core"]["ratio"]
        <= 1.1,
        "uint8 on every core <= 1.1x the floor on every core": like_for_like["every_core"]["ratio"]
        <= 1.1,
    }
    if "paired" in like_for_like:
        targets["uint8 <= 1.1x the floor, paired windows (median)"] = (
            like_for_like["paired"]["ratio"] <= 1.1
        )
    if "ours_uint8/tfm" in ratios:
        targets["ours_uint8/tfm >= 1.5"] = ratios["ours_uint8/tfm"] >= 1.5
    if "ours/tfm" in ratios:
        targets["ours/tfm >= 1.25"] = ratios["ours/tfm"] >= 1.25
    command = (
        "python benchmarks/input_pipeline.py"
        + (" --quick" if args.quick else "")
        + (f" --images {args.images}" if args.images != "noise" else "")
        + (" --tfm_python " + args.tfm_python if args.tfm_python else "")
    )
    result = {
        "command": command,
        "quick": args.quick,
        "machine": machine_info(),
        "data": info,
        "batch_size": args.batch_size,
        "image_size": IMAGE_SIZE,
        "rounds": rounds,
        "windows_per_round": args.windows,
        "window_seconds": args.window,
        "pipelines": pipelines,
        "ratios": ratios,
        "ratios_by_cpu_time": cpu_ratios,
        "output_modes": output_modes,
        "floor_cpu_ms_per_image": floor,
        "uint8_like_for_like": like_for_like,
        "targets_met": targets,
        "seconds": round(time.time() - started, 1),
    }
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(
        json.dumps(
            {
                "ratios": ratios,
                "ratios_by_cpu_time": cpu_ratios,
                "output_modes": output_modes,
                "floor_cpu_ms_per_image": floor,
                "uint8_like_for_like": like_for_like,
                "targets_met": targets,
                "decode_breakdown_cpu_ms": pipelines["decode_limit"]["cpu_ms_per_image_breakdown"],
            },
            indent=2,
        )
    )
    print(markdown_table(result))
    print(f"wrote {args.output} in {result['seconds']} s")


def measure_checks(args, info, rounds, started):
    """The uint8 training path with bad records skipped, named and counted (the default) against
    the same path at `--baseline_rev`: paired one-core windows, cores and starting order swapped
    every round."""
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--checks pairs two pinned processes: it needs two cores.")
    ours, baseline, ratios = [], [], []
    for round_index in range(rounds):
        core = round_index % 2
        jobs = [("ours_uint8_one_core", core), ("baseline_uint8_one_core", 1 - core)]
        results = _spawn_at_once(jobs[:: 1 - 2 * core], info, args)
        checked, previous = results[:: 1 - 2 * core]
        window_ratios = [
            c / p for c, p in zip(checked["cpu_ms_per_image"], previous["cpu_ms_per_image"])
        ]
        ours += checked["cpu_ms_per_image"]
        baseline += previous["cpu_ms_per_image"]
        ratios += window_ratios
        print(
            f"round {round_index + 1}/{rounds} checked on core {core} / {args.baseline_rev} on "
            f"core {1 - core}: " + ", ".join(f"{r:.3f}" for r in window_ratios),
            flush=True,
        )
    result = {
        "command": "python benchmarks/input_pipeline.py --checks"
        + (" --quick" if args.quick else "")
        + (f" --images {args.images}" if args.images != "noise" else ""),
        "baseline_rev": args.baseline_rev,
        "machine": machine_info(),
        "data": info,
        "batch_size": args.batch_size,
        "rounds": rounds,
        "windows_per_round": args.windows,
        "window_seconds": args.window,
        "checked_cpu_ms_per_image": round(statistics.median(ours), 3),
        "baseline_cpu_ms_per_image": round(statistics.median(baseline), 3),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(min(ratios), 3),
        "ratio_max": round(max(ratios), 3),
        "window_ratios": [round(r, 3) for r in ratios],
        "targets_met": {
            "checked CPU per image <= 1.1x the baseline (median)": (
                statistics.median(ratios) <= 1.1
            )
        },
        "seconds": round(time.time() - started, 1),
    }
    suffix = "" if args.images == "noise" else f"_{args.images}"
    output = os.path.join(RESULTS, f"input_pipeline_checks{suffix}.json")
    os.makedirs(RESULTS, exist_ok=True)
    with open(output, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "data")}, indent=2))
    print(f"wrote {output} in {result['seconds']} s")
    return result


if __name__ == "__main__":
    main()
