"""The writer's shards written by an Apache Beam pipeline, on any Beam runner.

    python -m tpu_scale.data.convert --image_dir photos --output_dir records \\
        --beam_pipeline_options \\
        "runner=DirectRunner,direct_num_workers=2,direct_running_mode=multi_processing"

For a folder too big for one machine, the runner is a cluster's (Dataflow, Flink, Spark) and the
folders are in a bucket (`gs://...`) that its workers read and write. The conversion is the one
the local writer (`write_tfrecords`) runs, from `tpu_scale.data.convert`: this process lists the
folders and computes the split, the label map and the shard plan once (`plan_conversion`); the
pipeline does only the per-image work and writes the planned shard files into the staging folder;
this process then names the shards, writes `labels.json` and `skipped.json` and publishes the
folder (`finish_conversion`), exactly as after the local writer. So the same folder and seed give
the same files, byte for byte, whichever writer ran.

The pipeline, one linear chain:

    shard names -> each shard's image list (a file of the plan) -> spread over the workers
      -> `convert_image` (the per-image function both writers share) -> grouped by shard
      -> each shard's records written in the plan's order (`write_shard`), and its counts beside it

The plan travels as files in the staging folder (one per shard), not in the pipeline's graph, which
runners bound in size. One worker holds a shard's records while it writes them (about 110 MB for
shards of 1,024 ImageNet-sized images). A retried bundle writes the same files again. Every file is
read and written through `tf.io.gfile`, so local folders, `gs://` buckets and every filesystem
TensorFlow reads work. On a cluster, the workers need this package and TensorFlow installed (for
Dataflow, a `--setup_file` or a container image) and must reach `image_dir` and `output_dir`.

Apache Beam is an optional dependency (`pip install -e ".[beam]"`): it is imported only when a
pipeline runs.
"""

import contextlib
import dataclasses
import io
import json
import os

import tensorflow as tf

from tpu_scale._files import is_local, remove_tree
from tpu_scale.data.names import inline

# The pipeline's own files in the staging folder: each shard's image list and, once it is written,
# its counts. Removed before the staging folder is published.
_SCRATCH = "beam"


def _beam():
    try:
        import apache_beam
    except ImportError as error:
        raise ImportError(f'beam_pipeline_options needs Apache Beam, which is not installed here ({error}): pip install -e ".[beam]" in a clone of tpu_scale, or pip install apache-beam.') from None
    return apache_beam


def _parse(parse):
    """`parse()`, with argparse's exit on a bad flag turned into a ValueError that names it."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            return parse()
    except SystemExit:
        # argparse's last line names the problem ("...: error: argument --x: invalid int value");
        # `help` exits without one.
        lines = stderr.getvalue().strip().splitlines() or ["help is not a pipeline option"]
        problem = lines[-1].split("error: ", 1)[-1]
        raise ValueError(f"Invalid Beam pipeline options: {problem}. python -m apache_beam.examples.wordcount --help lists every option.") from None


def pipeline_options(options):
    """Beam `PipelineOptions` from TFDS's flag form, checked before anything is written.

    Args:
      options: comma-separated `key=value` pipeline options, each a Beam flag without its dashes
        ("runner=DirectRunner,direct_num_workers=2,direct_running_mode=multi_processing"; a flag
        without a value, "save_main_session", sets it), or a `PipelineOptions` (used as it is).

    Returns:
      `apache_beam.options.pipeline_options.PipelineOptions`.

    Raises:
      ImportError: Apache Beam is not installed.
      ValueError: an option no Beam options class knows, a value of the wrong type or choice, or a
        runner that cannot be created.
    """
    beam = _beam()
    from apache_beam.options.pipeline_options import PipelineOptions

    if not isinstance(options, PipelineOptions):
        items = [item.strip() for item in str(options).split(",") if item.strip()]
        if not items:
            raise ValueError('beam_pipeline_options is empty: give comma-separated key=value Beam pipeline options, e.g. "runner=DirectRunner,direct_num_workers=2".')
        flags = [item if item[:2] == "--" else f"--{item}" for item in items]
        options = _parse(lambda: PipelineOptions(flags))
    known = set(PipelineOptions([]).get_all_options())
    unknown = sorted(
        set(_parse(lambda: options.get_all_options(retain_unknown_options=True))) - known
    )
    if unknown:
        raise ValueError(f"Unknown Beam pipeline option(s): {', '.join(unknown)}. Options are Beam's flags without their dashes (e.g. direct_num_workers=2); a runner's own options come with its extra (pip install \"apache-beam[gcp]\" for Dataflow's).")
    runner = _parse(options.get_all_options)["runner"] or "DirectRunner"
    try:
        beam.Pipeline(options=options)  # creates the runner, which is all that is checked here
    except (ValueError, ImportError) as error:
        raise ValueError(f"Beam runner {runner!r} cannot be used: {error}") from None
    return options


def _absolute(path, base_dir):
    """`path` as the workers must see it: a relative local path taken from this process's folder."""
    return os.path.join(base_dir, path) if is_local(path) else path


def _shard_images(shard_number, scratch, names):
    """(shard, position in the shard, path, class id) of each image of a planned shard."""
    with tf.io.gfile.GFile(os.path.join(scratch, names[shard_number] + ".images")) as f:
        for position, line in enumerate(f):
            path, class_id = json.loads(line)
            yield shard_number, position, path, class_id


def _convert(image, convert_image, class_names, label_offset, base_dir, limits):
    shard_number, position, path, class_id = image
    converted = convert_image(
        _absolute(path, base_dir), class_id, class_names, label_offset, **limits
    )
    # Named as the listing names it, as the local writer reports it.
    return shard_number, (position, dataclasses.replace(converted, path=path))


def _write(shard, write_shard, names, staging_dir, scratch, num_classes):
    shard_number, images = shard
    images = [image for _, image in sorted(images, key=lambda pair: pair[0])]
    result = write_shard(os.path.join(staging_dir, names[shard_number]), images, num_classes)
    # The counts, for this process to read once the pipeline has finished: the last file written.
    with tf.io.gfile.GFile(os.path.join(scratch, names[shard_number] + ".json"), "w") as f:
        f.write(json.dumps(dataclasses.asdict(result)))


def write_shards(plan, staging_dir: str, options, *, convert_image, write_shard) -> list[dict]:
    """Runs the pipeline that writes the shards of `plan` into `staging_dir`.

    Args:
      plan: the conversion's plan (`convert.plan_conversion`).
      staging_dir: the staging folder (`output_dir.make_staging_dir`).
      options: `PipelineOptions`, as `pipeline_options` returns them.
      convert_image: the per-image work (`convert.convert_image`), run on the workers.
      write_shard: the shard writer (`convert.write_shard`), run on the workers. Both are given
        by `convert.write_tfrecords`, so that this module, which it imports, imports it not back.

    Returns:
      The fields of each planned shard's `convert.ShardResult`, in the plan's order.

    Raises:
      RuntimeError: the pipeline finished without writing a planned shard.
    """
    beam = _beam()
    base_dir = os.getcwd()
    staging_dir = _absolute(staging_dir, base_dir)
    scratch = os.path.join(staging_dir, _SCRATCH)
    tf.io.gfile.makedirs(scratch)
    names = [shard.staging_name for shard in plan.shards]
    for name, shard in zip(names, plan.shards):
        with tf.io.gfile.GFile(os.path.join(scratch, name + ".images"), "w") as f:
            f.write("".join(json.dumps(image) + "\n" for image in shard.images))
    num_classes = len(plan.class_names)
    # The same caps as the local writer's: a worker reads no file above the size cap and decodes
    # no image above the pixel cap (the listing here skipped the local files above the size cap).
    limits = dict(max_pixels=plan.max_pixels, max_file_bytes=plan.max_file_bytes)
    with beam.Pipeline(options=options) as pipeline:
        _ = (
            pipeline
            | "Shards" >> beam.Create(range(len(names)))
            | "Images" >> beam.FlatMap(_shard_images, scratch, names)
            | "Spread" >> beam.Reshuffle()
            | "Convert"
            >> beam.Map(
                _convert, convert_image, plan.class_names, plan.label_offset, base_dir, limits
            )
            | "By shard" >> beam.GroupByKey()
            | "Write" >> beam.Map(_write, write_shard, names, staging_dir, scratch, num_classes)
        )
    results = []
    for name in names:
        path = os.path.join(scratch, name + ".json")
        if not tf.io.gfile.exists(path):
            raise RuntimeError(f"The Beam pipeline finished without writing the shard {name} (no {inline(path)}): can its workers reach {inline(staging_dir)}?")
        with tf.io.gfile.GFile(path) as f:
            results.append(json.load(f))
    remove_tree(scratch)
    return results
