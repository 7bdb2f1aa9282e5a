"""The pipelines the input benchmarks time, each in a process of its own, and running them.

    import input_workers
    run = input_workers.setup(args)                   # the records and the timing (shared flags)
    result = input_workers.spawn(run, "ours_uint8")   # one worker process: its timed windows
    a, b, ratios = input_workers.paired(run, "ours_uint8_one_core", "floor", round_index)

Workers (`python benchmarks/input_workers.py --worker NAME ...`, started by `spawn`):

  ours, ours_bfloat16, ours_uint8
                `tpu_scale.data.ImageNetInput(..., is_training=True)` with output dtype float32,
                bfloat16 or uint8 (normalized on the device): the full training path, default
                options.
  ours_uint8_one_core
                the uint8 path pinned to one core, with one tf.data thread and one thread in each
                of TensorFlow's op pools: the floor's conditions.
  baseline_uint8_one_core, baseline_uint8
                ours_uint8_one_core and ours_uint8 with `ImageNetInput` as it was at
                `--baseline_rev` (loaded from git).
  tfm           tf-models-official's ImageNet classification input (`classification_input.Decoder`
                and `Parser` under its `InputReader`, as its classification task builds them); it
                pins its own TensorFlow, so it runs with another environment's python.
  naive         sequential read, full JPEG decode, resize, flip, normalize, batch.
  decode_one_core
                decode-and-crop alone (JPEG header, Inception window, `decode_and_crop_jpeg`; no
                resize, no tf.data), pinned to one core: cores x its rate is the host's ceiling.
  floor         the required host work of the uint8 path and nothing else (decode-and-crop, resize,
                flip) as a graph loop of TensorFlow's kernels over in-memory JPEGs, pinned to one
                core.

Each worker times `windows` windows of `window` seconds after a `warmup` and reports images/s and
CPU milliseconds per image per window, and its peak RSS. Workers started together (`spawn_at_once`)
wait at a barrier, so their timed windows start at the same time.
"""

import argparse
import dataclasses
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from common import ROOT
from input_data import generate_records

IMAGE_SIZE = 224

# --------------------------------------------------------------------------- in the worker process


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
    """A `next_batch` callable over `dataset`."""
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


# The modules of `tpu_scale.data` that make up the pipeline, loaded from git for a baseline when
# the commit has them (the rest of `tpu_scale.data` is shared).
_PIPELINE_MODULES = ("input_pipeline", "sources", "image_ops", "bad_records", "input_config")


def baseline_input_class(rev):
    """`ImageNetInput` as it was at commit `rev`: its pipeline modules read from git into a
    package of their own."""
    import importlib

    package = os.path.join(tempfile.mkdtemp(), "baseline_data")
    os.makedirs(package)
    open(os.path.join(package, "__init__.py"), "w").close()
    texts = {}
    for module in _PIPELINE_MODULES:
        shown = subprocess.run(
            ["git", "-C", ROOT, "show", f"{rev}:tpu_scale/data/{module}.py"],
            capture_output=True,
            text=True,
        )
        if shown.returncode == 0:
            texts[module] = shown.stdout
    for module, text in texts.items():
        text = text.replace(
            "from tpu_scale.data import image_ops, sources",
            "from baseline_data import image_ops, sources",
        )
        for other in texts:
            text = text.replace(f"from tpu_scale.data.{other} import", f"from baseline_data.{other} import")
        with open(os.path.join(package, f"{module}.py"), "w") as f:
            f.write(text)
    sys.path.insert(0, os.path.dirname(package))
    return importlib.import_module("baseline_data.input_pipeline").ImageNetInput


def worker_ours(args, dtype="float32", one_core=False, baseline=False):
    """`ImageNetInput`'s training path (fused decode-and-crop, resize, flip, normalize or not,
    batch), default options; `one_core`: pinned to one core with one thread everywhere (the
    floor's conditions); `baseline`: the class as it was at `--baseline_rev`."""
    if one_core:
        _pin_to_one_core(args.core)
    if baseline:
        ImageNetInput = baseline_input_class(args.baseline_rev)
    else:
        from tpu_scale.data import ImageNetInput

    threads = 1 if one_core else None
    if "config" in inspect.signature(ImageNetInput).parameters:
        from tpu_scale.data import InputConfig

        settings = dict(config=InputConfig(threadpool_size=threads))
    else:  # a baseline from before the configuration
        settings = dict(threadpool_size=threads)
    inp = ImageNetInput(
        args.pattern,
        is_training=True,
        global_batch_size=args.batch_size,
        image_size=IMAGE_SIZE,
        dtype=dtype,
        **settings,
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
    """Sequential read, full JPEG decode, resize to 224, flip, normalize, batch; no parallelism."""
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
    """Runs the worker `args.worker` and prints its result as one `RESULT {json}` line."""
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


# --------------------------------------------------------------------------- in the driver


@dataclasses.dataclass
class Run:
    """What every worker of one benchmark run gets: the records, the batch and the timing."""

    data: dict  # generate_records's description of the records
    batch_size: int
    rounds: int  # interleaved rounds of the benchmark
    warmup: float  # seconds each worker runs untimed first
    window: float  # seconds per timed window
    windows: int  # timed windows per worker
    images: str
    baseline_rev: str = BASELINE_REV

    @property
    def cores(self):
        return len(os.sched_getaffinity(0))

    def suffix(self):
        """The results file's suffix: "" for the generated images, "_photos" for photos."""
        return "" if self.images == "noise" else f"_{self.images}"


def add_flags(parser):
    """The flags every input benchmark shares: --quick, --images, --data_dir, --batch_size."""
    parser.add_argument(
        "--quick", action="store_true", help="256 images, 2 rounds of 2 windows of 3 s"
    )
    parser.add_argument(
        "--images",
        choices=("noise", "photos"),
        default="noise",
        help="generated noise that compresses like photographs, or views of real photographs "
        "(scikit-learn's sample images)",
    )
    parser.add_argument("--data_dir", help="where the generated TFRecords are kept")
    parser.add_argument("--batch_size", type=int, default=64)


def setup(args, rounds=3, quick_rounds=2):
    """The `Run` of `args` (`add_flags`'s): the records, generated once per folder, and the timing
    (`rounds` interleaved rounds, or `quick_rounds` with --quick)."""
    num_images = 256 if args.quick else 1024
    suffix = "" if args.images == "noise" else f"_{args.images}"
    data_dir = args.data_dir or f"/tmp/tpu_scale_input_bench_{num_images}{suffix}"
    data = generate_records(data_dir, num_images, num_shards=16, images=args.images)
    print(f"data: {num_images} JPEGs, mean {data['mean_jpeg_kb']} KB, in {data_dir}", flush=True)
    windows, window, warmup = (2, 3.0, 2.0) if args.quick else (3, 8.0, 5.0)
    return Run(
        data=data,
        batch_size=args.batch_size,
        rounds=quick_rounds if args.quick else rounds,
        warmup=warmup,
        window=window,
        windows=windows,
        images=args.images,
    )


def _command(run, worker, python=None, pattern=None, **extra):
    command = [python or sys.executable, os.path.abspath(__file__), "--worker", worker]
    command += ["--pattern", pattern or run.data["pattern"]]
    for key in ("batch_size", "warmup", "window", "windows", "baseline_rev"):
        command += [f"--{key}", str(getattr(run, key))]
    for key, value in extra.items():
        command += [f"--{key}", str(value)]
    return command


def _result_of(worker, returncode, stdout, stderr):
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = "\n".join((stderr or stdout).strip().splitlines()[-12:])
    raise RuntimeError(f"{worker} worker failed (exit {returncode}):\n{tail}")


_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)


def spawn(run, worker, python=None, pattern=None, core=None):
    """Runs `worker` in a process of its own (with `python`, on the files of `pattern`, pinned to
    `core` if the worker pins); its result: lists of images/s and CPU ms per image, one per window,
    and its peak RSS."""
    extra = {} if core is None else {"core": core}
    command = _command(run, worker, python, pattern, **extra)
    completed = subprocess.run(command, capture_output=True, text=True, env=_ENV, timeout=900)
    return _result_of(worker, completed.returncode, completed.stdout, completed.stderr)


def spawn_at_once(run, jobs):
    """Runs `jobs` ((worker, core) pairs) at the same time, their timed windows started together;
    their results, in order."""
    with tempfile.TemporaryDirectory() as barrier:
        procs = [
            subprocess.Popen(
                _command(run, worker, core=core, barrier=f"{barrier}:{len(jobs)}"),
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


def on_every_core(run, worker):
    """One `worker` process per core, all at once; their windows pooled into one result."""
    results = spawn_at_once(run, [(worker, core) for core in range(run.cores)])
    merged = {
        key: sum((r[key] for r in results), []) for key in ("images_per_second", "cpu_ms_per_image")
    }
    merged["peak_rss_mb"] = max(r["peak_rss_mb"] for r in results)
    merged["tensorflow"] = results[0]["tensorflow"]
    return merged


def paired(run, first, second, round_index):
    """Workers `first` and `second` at the same time, each pinned to its own core, cores and
    starting order swapped every other round (started second, the same worker measures a few
    percent more CPU per image): `(first's result, second's result, window ratios of their CPU ms
    per image)`. A load from other users of the machine lifts both alike, so each pair of windows
    gives one ratio."""
    if run.cores < 2:
        raise SystemExit("pairing two pinned processes needs two cores.")
    core = round_index % 2
    jobs = [(first, core), (second, 1 - core)]
    a, b = spawn_at_once(run, jobs[:: 1 - 2 * core])[:: 1 - 2 * core]
    ratios = [x / y for x, y in zip(a["cpu_ms_per_image"], b["cpu_ms_per_image"])]
    return a, b, ratios


def interleave(run, jobs):
    """Calls every job once per round, in turn, for `run.rounds` rounds, so that a slow spell of the
    machine hits all of them: {name: [result of each round]}.

    Args:
      run: the `Run`.
      jobs: {name: f(round_index)}, each returning a worker's result (a paired job's may hold the
        window `ratios`, which the round's line shows).
    """
    results = {name: [] for name in jobs}
    for round_index in range(run.rounds):
        for name, job in jobs.items():
            result = job(round_index)
            results[name].append(result)
            ratios = ", ".join(f"{x:.3f}" for x in result.get("ratios", []))
            print(
                f"round {round_index + 1}/{run.rounds} {name:20s} "
                f"{statistics.median(result['images_per_second']):8.1f} images/s "
                f"{statistics.median(result['cpu_ms_per_image']):6.2f} CPU ms/image "
                f"peak RSS {result['peak_rss_mb']:.0f} MB"
                + (f"; window CPU ratios {ratios}" if ratios else ""),
                flush=True,
            )
    return results


def spread(values, digits=1):
    """Median, min, max (rounded) and the number of values."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "samples": len(values),
    }


def pooled(results):
    """The windows of several results of one worker: images/s spread, median CPU ms per image, the
    largest peak RSS."""
    return dict(
        spread(sum((r["images_per_second"] for r in results), [])),
        cpu_ms_per_image=round(
            statistics.median(sum((r["cpu_ms_per_image"] for r in results), [])), 3
        ),
        peak_rss_mb=round(max(r["peak_rss_mb"] for r in results)),
        tensorflow=results[0]["tensorflow"],
    )


def write(result, path):
    """Writes `result` as JSON to `path`."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def main():
    """A worker process: `--worker NAME` and its settings."""
    parser = argparse.ArgumentParser(description="one worker of the input benchmarks")
    parser.add_argument("--worker", choices=sorted(WORKERS), required=True)
    parser.add_argument("--pattern", required=True)
    parser.add_argument("--batch_size", type=int, required=True)
    parser.add_argument("--warmup", type=float, required=True)
    parser.add_argument("--window", type=float, required=True)
    parser.add_argument("--windows", type=int, required=True)
    parser.add_argument("--baseline_rev", default=BASELINE_REV)
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--barrier", default=None)
    run_worker(parser.parse_args())


if __name__ == "__main__":
    main()
