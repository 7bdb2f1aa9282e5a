"""Trains a ResNet on ImageNet-layout data with the large-batch recipe: TPU pod, GPUs or this CPU.

`model.fit` under `tpu_scale.create_strategy`, with grouped batch norm, the 2-D torus gradient sum,
the fused decode-and-crop input pipeline, the recipe for the global batch size
(`tpu_scale.schedules.recipe_for_batch`: momentum SGD below 512, LARS from 512, warmup + polynomial
decay, label smoothing) and, optionally, bfloat16. The host normalizes the images;
`--input_dtype uint8` sends raw pixels instead, which the model's first layer normalizes (on this
CPU the step, not the host, is the bottleneck, so that measured slower; see benchmarks/README.md).
Evaluates every epoch, logs images/s, stops a diverging run with the flags that fix it, and ends
with one line:
`top-1 <accuracy> | <images/s> | wall <seconds>`, then where every output is.

This CPU, the built-in default: generates a small learnable dataset of real JPEGs in TFRecords in a
temporary folder (nothing is downloaded) and trains a small ResNet on 8 virtual CPU replicas in a
2x4 mesh:

    python examples/train_imagenet.py

Eight replicas show the 2-D torus; on a machine with few cores, one replica per core trains
faster (`--num_cpu_replicas 2` on 2 cores: the mesh defaults to the squarest one, 1x2).

Your own images (a folder with one sub-folder of images per class): two commands, no other flags.
The writer splits off a stratified validation set (10%), checks every image and writes a label map
(labels.json) that this script reads for the classes, the label offset and the example counts:

    python -m tpu_scale.data.write_tfrecords --image_dir ~/flowers --output_dir ~/flowers_records
    python examples/train_imagenet.py --data_dir ~/flowers_records --image_size 64

Give --model_dir DIR to keep what a run writes: checkpoints of the last --keep_checkpoints epochs,
TensorBoard logs, a backup to resume from, the final model (final.keras; read it back with
`tpu_scale.models.load_model`), run.json and the settings it started with (settings.json: a
resumed run names every setting that differs). The same command after an interruption resumes from
the last finished epoch (it says so); on a finished run it says so and stops, and a larger --epochs
continues it. Backups are written atomically, so a kill at any moment loses at most the epoch in
progress; a SIGTERM (a scheduler's preemption notice) makes every worker save at the same step and
exit with code 143, and the same command resumes there. Without --model_dir everything goes to a
temporary folder that is removed at the end. A progress bar shows in a terminal (--noprogress turns
it off).

A Cloud TPU v3-8 (ImageNet in the classic layout: train-* and validation-* files):

    python examples/train_imagenet.py --tpu $TPU_NAME --data_dir gs://my-bucket/imagenet \
        --model resnet50 --image_size 224 --num_classes 1000 --global_batch_size 1024 \
        --epochs 90 --mixed_precision bfloat16 --model_dir gs://my-bucket/runs/v3-8

A v3-1024 pod slice, the paper's configuration (batch 32768 = 16 per core, LARS, BN groups of 4
cores = span 64; the reference LR 34 and 12 warmup epochs come from the batch size):

    python examples/train_imagenet.py --tpu $TPU_NAME --data_dir gs://my-bucket/imagenet \
        --model resnet50 --image_size 224 --num_classes 1000 --global_batch_size 32768 \
        --epochs 72 --bn_group_size 4 --mixed_precision bfloat16 \
        --model_dir gs://my-bucket/runs/v3-1024

Two GPU hosts (run on each host, with its own task index; rows of the mesh are the hosts; the
model_dir must be on a filesystem both hosts read):

    TF_CONFIG='{"cluster": {"worker": ["host1:2222", "host2:2222"]},
                "task": {"type": "worker", "index": 0}}' \
    python examples/train_imagenet.py --data_dir /data/imagenet --model resnet50 \
        --image_size 224 --num_classes 1000 --global_batch_size 512 --epochs 90 \
        --mixed_precision float16 --model_dir /shared/run
"""

import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Optional

from absl import app, flags, logging

# TensorFlow's C++ INFO and WARNING lines (a "Local rendezvous ... CANCELLED" for every iterator a
# pass over the data ends, one per start-up probe) would drown the progress lines; errors still
# show, and so do Python warnings.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's default CPU allocator gives large buffers back to the system when they are freed,
# so every step faults its activations in again: on a 2-core machine 88 of the default run's 234
# CPU seconds went to the kernel, mostly page faults. Its BFC allocator keeps them for reuse (the
# default run: 148-153 -> 272-312 images/s, 6% more peak memory). Read once, when TensorFlow starts;
# TF_CPU_ALLOCATOR_USE_BFC=0 in the environment turns it off.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "1")

# Runnable from a checkout without installing: the package sits next to this folder.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IMAGENET_TRAIN_EXAMPLES = 1_281_167
# Fewer optimizer steps than this in a whole run earn a hint to train longer (scikit-learn's digits
# at the defaults: 72 steps, top-1 about 0.3; 30 epochs, 360 steps: about 0.85).
_FEW_STEPS = 300
IMAGENET_EVAL_EXAMPLES = 50_000


@dataclasses.dataclass
class TrainConfig:
    """Everything a run needs; the defaults are the CPU default run."""

    tpu: Optional[str] = None
    data_dir: Optional[str] = None
    tfds_name: Optional[str] = None
    tfds_data_dir: Optional[str] = None
    label_offset: Optional[int] = None
    num_classes: Optional[int] = None
    train_examples: Optional[int] = None
    eval_examples: Optional[int] = None
    image_size: int = 64
    model: str = "small_resnet"
    global_batch_size: int = 128
    epochs: int = 6
    bn_group_size: Optional[int] = None
    gradient_reduction: str = "torus"
    mixed_precision: str = "float32"
    input_dtype: str = "float"
    optimizer: Optional[str] = None
    peak_learning_rate: Optional[float] = None
    warmup_epochs: Optional[float] = None
    weight_decay: Optional[float] = None
    label_smoothing: Optional[float] = None
    model_dir: Optional[str] = None
    num_cpu_replicas: int = 8
    mesh_shape: Optional[str] = None
    deterministic: bool = False
    seed: int = 0
    progress: Optional[bool] = None
    keep_checkpoints: int = 3
    # Synthetic default data: examples per split.
    synthetic_train_examples: int = 2560
    synthetic_eval_examples: int = 512


def define_flags():
    defaults = TrainConfig()
    kinds = {
        str: flags.DEFINE_string,
        int: flags.DEFINE_integer,
        float: flags.DEFINE_float,
        bool: flags.DEFINE_bool,
    }
    helps = {
        "tpu": "TPU name or address, or 'local' on a TPU VM. Empty: GPUs, TF_CONFIG hosts, CPU.",
        "data_dir": "Folder of TFRecords (train-*, validation-*). Empty: generated JPEGs.",
        "tfds_name": "A TFDS dataset (e.g. imagenet2012) instead of --data_dir.",
        "tfds_data_dir": "TFDS data directory.",
        "label_offset": "Subtracted from stored labels. Default: the label map's (labels.json), "
        "else 1 (the classic 1-based ImageNet files).",
        "num_classes": "Classes. Default: the label map's; 1000 for the classic ImageNet files.",
        "train_examples": "Training examples per epoch. Default: the label map's, else counted.",
        "eval_examples": "Evaluation examples. Default: the label map's count, else counted.",
        "image_size": "Image height and width.",
        "model": "resnet50 or small_resnet.",
        "global_batch_size": "Examples per step over all replicas; a multiple of the replicas.",
        "epochs": "Training epochs.",
        "bn_group_size": "Replicas per batch-norm group. Empty: the smallest spanning 64 examples.",
        "gradient_reduction": "torus (2-D torus sum) or native (TensorFlow's all-reduce).",
        "mixed_precision": "float32, bfloat16 (TPU, CPU) or float16 (GPU).",
        "input_dtype": "uint8: the host sends raw pixels, which the model's first layer "
        "normalizes; float: the host normalizes (float32, or bfloat16 with --mixed_precision "
        "bfloat16).",
        "optimizer": "lars or sgd (momentum 0.9). Default: the recipe for the batch size "
        "(tpu_scale.schedules.recipe_for_batch: sgd below 512, lars from 512).",
        "peak_learning_rate": "Peak learning rate. Default: the recipe's for batch and optimizer.",
        "warmup_epochs": "Warmup epochs. Default: the recipe's.",
        "weight_decay": "Weight decay (none on batch-norm parameters, biases). Default: recipe's.",
        "label_smoothing": "Label smoothing. Default: the recipe's.",
        "model_dir": "Checkpoints, logs, the backup to resume from, the final model. Empty: none.",
        "num_cpu_replicas": "Virtual CPU replicas without an accelerator (per TF_CONFIG worker).",
        "mesh_shape": "ROWSxCOLS mesh of a single host's replicas. Default: the squarest one "
        "(2x4 for 8 replicas, 1x2 for 2).",
        "deterministic": "Reproducible input order and crops (slower), for comparing runs.",
        "seed": "Random seed.",
        "progress": "Keras progress bar. Default: on when the output is a terminal.",
        "keep_checkpoints": "The newest per-epoch checkpoints kept in model_dir/checkpoints.",
        "synthetic_train_examples": "Training examples of the generated default dataset.",
        "synthetic_eval_examples": "Evaluation examples of the generated default dataset.",
    }
    for field in dataclasses.fields(TrainConfig):
        kind = (
            field.type
            if field.type in kinds
            else (
                int
                if "int" in str(field.type)
                else float
                if "float" in str(field.type)
                else bool
                if "bool" in str(field.type)
                else str
            )
        )
        kinds[kind](field.name, getattr(defaults, field.name), helps[field.name])


# --------------------------------------------------------------------------- set-up


def _mesh_shape(config):
    """The one-host mesh: `--mesh_shape` if given, else the squarest for the replicas."""
    if not config.mesh_shape:
        n = config.num_cpu_replicas
        rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
        return rows, n // rows
    text = config.mesh_shape
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh_shape={text!r} must look like ROWSxCOLS, e.g. 2x4.") from None
    return rows, cols


def _check_config(config, strategy=None):
    """Fails at start, with the fix, on flag combinations that cannot work."""
    for name in ("data_dir", "model_dir", "tfds_data_dir"):
        value = getattr(config, name)
        if value and value.startswith("~"):
            # `--flag=~/x` reaches us unexpanded (the shell expands `~` only at a word's start).
            setattr(config, name, os.path.expanduser(value))
    if config.data_dir and config.tfds_name:
        raise ValueError("Give --data_dir or --tfds_name, not both.")
    if config.model not in ("resnet50", "small_resnet"):
        raise ValueError(f"--model={config.model!r}: choose resnet50 or small_resnet.")
    if config.optimizer not in (None, "lars", "sgd"):
        raise ValueError(f"--optimizer={config.optimizer!r}: choose lars or sgd.")
    if config.mixed_precision not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            f"--mixed_precision={config.mixed_precision!r}: choose float32, bfloat16 or float16."
        )
    if config.input_dtype not in ("uint8", "float"):
        raise ValueError(f"--input_dtype={config.input_dtype!r}: choose uint8 or float.")
    if config.epochs < 1 or config.global_batch_size < 1 or config.num_cpu_replicas < 1:
        raise ValueError("--epochs, --global_batch_size and --num_cpu_replicas must be at least 1.")
    if strategy is None:
        return
    replicas = strategy.num_replicas_in_sync
    if config.global_batch_size % replicas:
        raise ValueError(
            f"--global_batch_size={config.global_batch_size} does not divide over {replicas} "
            f"replicas; use a multiple of {replicas}, e.g. "
            f"{replicas * max(1, config.global_batch_size // replicas)}."
        )
    if config.bn_group_size is not None:
        strategy.mesh.group_assignment(config.bn_group_size)  # raises with the valid sizes


def _make_default_dataset(config):
    from tpu_scale import data

    folder = tempfile.mkdtemp(prefix="tpu_scale_synthetic_")
    made = data.make_synthetic_imagenet(
        folder,
        num_classes=config.num_classes or 10,
        train_examples=config.synthetic_train_examples,
        eval_examples=config.synthetic_eval_examples,
        image_shape=(config.image_size, config.image_size),
        seed=config.seed,
    )
    logging.info(
        "Generated %d + %d synthetic JPEG examples in %s (removed at the end)",
        config.synthetic_train_examples,
        config.synthetic_eval_examples,
        folder,
    )
    return folder, made["num_classes"]


def _count_records(pattern):
    import tensorflow as tf

    files = tf.io.gfile.glob(pattern)
    return sum(1 for _ in tf.data.TFRecordDataset(files)) if files else 0


def _looks_like_imagenet(train_pattern):
    """The classic ImageNet files: 1024 training shards named train-NNNNN-of-01024."""
    import tensorflow as tf

    files = tf.io.gfile.glob(train_pattern)
    return len(files) == 1024 and all(f.endswith("-of-01024") for f in files)


def _resolve_records(config, data_dir):
    """Classes, label offset and example counts of a folder of shards: the label map's, or the
    flags'."""
    import tensorflow as tf

    from tpu_scale import data

    train_pattern = os.path.join(data_dir, "train-*")
    eval_pattern = os.path.join(data_dir, "validation-*")
    if not tf.io.gfile.isdir(data_dir):
        raise ValueError(f"--data_dir {data_dir} does not exist (or is not a folder).")
    _refuse_image_folder(data_dir)
    label_map = data.read_label_map(data_dir)
    if label_map is not None:
        if config.num_classes not in (None, label_map.num_classes):
            raise ValueError(
                f"--num_classes={config.num_classes} but the label map {label_map.path} lists "
                f"{label_map.num_classes} classes. Drop --num_classes (it is read from the label "
                "map)."
            )
        config.num_classes = label_map.num_classes
        if config.label_offset is None:
            config.label_offset = label_map.label_offset
        counts = label_map.counts
        train = config.train_examples or counts.get("train") or _count_records(train_pattern)
        evaluation = (
            config.eval_examples or counts.get("validation") or _count_records(eval_pattern)
        )
        logging.info(
            "Label map %s: %d classes, label offset %d, %d train / %d validation examples",
            label_map.path,
            label_map.num_classes,
            label_map.label_offset,
            train,
            evaluation,
        )
    else:
        imagenet = _looks_like_imagenet(train_pattern)
        if config.num_classes is None:
            if not imagenet:
                raise ValueError(
                    f"{data_dir} has no label map (labels.json) and is not the classic ImageNet "
                    "layout, so "
                    "the number of classes is unknown. Write the records with python -m "
                    "tpu_scale.data.write_tfrecords (it writes the label map), or pass "
                    "--num_classes."
                )
            config.num_classes = 1000
        if config.label_offset is None:
            config.label_offset = 1
        imagenet = imagenet and config.num_classes == 1000
        train = config.train_examples or (
            IMAGENET_TRAIN_EXAMPLES if imagenet else _count_records(train_pattern)
        )
        evaluation = config.eval_examples or (
            IMAGENET_EVAL_EXAMPLES if imagenet else _count_records(eval_pattern)
        )
    if train == 0:
        raise ValueError(f"No training records match {train_pattern}.")
    if evaluation == 0 and label_map is not None:
        raise ValueError(
            f"The records in {data_dir} hold no validation split (its label map counts 0 "
            "validation images). Write them again with a validation set: python -m "
            "tpu_scale.data.write_tfrecords --image_dir IMAGES --output_dir "
            f"{data_dir} --overwrite (it keeps at least one image of every class with two or more "
            "for validation), or give --validation_dir."
        )
    if evaluation == 0:
        raise ValueError(
            f"No validation records match {eval_pattern}. Write them with python -m "
            "tpu_scale.data.write_tfrecords (it splits off a validation set by default)."
        )
    if train < config.global_batch_size:
        logging.warning(
            "The training set (%d images) is smaller than --global_batch_size=%d: every epoch is "
            "one step that repeats images. A smaller --global_batch_size trains better here.",
            train,
            config.global_batch_size,
        )
    return train_pattern, eval_pattern, train, evaluation


def _refuse_image_folder(data_dir):
    """Fails, naming the conversion command, when `data_dir` holds class folders of images rather
    than records."""
    import tensorflow as tf

    from tpu_scale.data.image_folder import IMAGE_EXTENSIONS

    if tf.io.gfile.glob(os.path.join(data_dir, "train-*")):
        return
    for name in sorted(tf.io.gfile.listdir(data_dir))[:50]:
        folder = os.path.join(data_dir, name.rstrip("/"))
        if tf.io.gfile.isdir(folder) and any(
            entry.lower().endswith(IMAGE_EXTENSIONS) for entry in tf.io.gfile.listdir(folder)
        ):
            raise ValueError(
                f"--data_dir {data_dir} holds folders of images (e.g. {name.rstrip('/')}/), not "
                "TFRecords. Convert them first: python -m tpu_scale.data.write_tfrecords "
                f"--image_dir {data_dir} --output_dir {data_dir.rstrip('/')}_records, then pass "
                f"--data_dir {data_dir.rstrip('/')}_records."
            )


def _inputs(config, data_dir, pad_eval):
    """The train and eval `ImageNetInput`s and their example counts."""
    from tpu_scale import data

    common = dict(
        global_batch_size=config.global_batch_size,
        image_size=config.image_size,
        dtype=_input_dtype(config),
    )
    if config.tfds_name:
        train = data.ImageNetInput.from_tfds(
            config.tfds_name,
            "train",
            config.tfds_data_dir,
            is_training=True,
            deterministic=config.deterministic,
            seed=config.seed,
            **common,
        )
        evaluation = data.ImageNetInput.from_tfds(
            config.tfds_name,
            "validation",
            config.tfds_data_dir,
            is_training=False,
            pad_last_batch=pad_eval,
            **common,
        )
        return train, evaluation, _tfds_counts(config)
    train_pattern, eval_pattern, train_count, eval_count = _resolve_records(config, data_dir)
    labels = dict(label_offset=config.label_offset, num_classes=config.num_classes)
    train = data.ImageNetInput(
        train_pattern,
        is_training=True,
        deterministic=config.deterministic,
        seed=config.seed,
        **labels,
        **common,
    )
    evaluation = data.ImageNetInput(
        eval_pattern, is_training=False, pad_last_batch=pad_eval, **labels, **common
    )
    return train, evaluation, (train_count, eval_count)


def _input_dtype(config):
    """The images' dtype from the host: raw uint8 pixels, or normalized in the model's precision."""
    if config.input_dtype == "uint8":
        return "uint8"
    return "bfloat16" if config.mixed_precision == "bfloat16" else "float32"


def _tfds_counts(config):
    import tensorflow_datasets as tfds

    info = tfds.builder(config.tfds_name, data_dir=config.tfds_data_dir).info
    config.num_classes = config.num_classes or info.features["label"].num_classes
    return (
        config.train_examples or info.splits["train"].num_examples,
        config.eval_examples or info.splits["validation"].num_examples,
    )


def eval_steps(num_examples, global_batch_size, num_replicas, num_input_pipelines):
    """Steps of one pass over `num_examples` evaluation examples on one input pipeline, the last
    partial.

    The pipeline batches the examples into per-replica batches and the distributed dataset hands one
    to every replica per step. Several pipelines (hosts) read files of different sizes, so their
    counts are not known here: None lets each pass run to the end of the data.
    """
    if num_input_pipelines != 1:
        return None
    per_replica_batches = math.ceil(num_examples / (global_batch_size // num_replicas))
    return max(1, math.ceil(per_replica_batches / num_replicas))


def eval_dataset_fn(eval_input, steps):
    """`distribute_datasets_from_function`'s function for evaluation passes of exactly `steps`
    steps.

    Each pass is topped up with empty batches to a whole number of steps and the passes repeat, so
    that every evaluation sees every example exactly once, whether it reads a new iterator or one
    kept from the pass before (Keras 3.15 makes a new one at every `evaluate`, inside `fit` too).
    Exact steps also keep Keras from warning that the input "ran out of data".
    """
    import tensorflow as tf

    def make(context):
        data = eval_input.dataset(context)
        if steps is None:
            return data
        replicas = context.num_replicas_in_sync // context.num_input_pipelines
        batches = steps * replicas  # per-replica batches in one pass, topped up
        images, labels = data.element_spec[:2]
        empty = tf.data.Dataset.from_tensors(
            (
                tf.zeros([0] + images.shape[1:].as_list(), images.dtype),
                tf.zeros([0], labels.dtype),
            )
        )
        # The pass's own batches (at most `batches`), then empty ones up to a whole number of steps.
        return data.concatenate(empty.repeat()).take(batches).repeat()

    return make


def _recipe(config):
    """The recipe for the global batch size (`schedules.recipe_for_batch`), with the flags given."""
    from tpu_scale import schedules

    recipe = schedules.recipe_for_batch(config.global_batch_size, total_epochs=config.epochs)
    if config.optimizer == "sgd" and recipe.optimizer != "sgd":
        # The recipe's momentum-SGD rule, past the batch sizes where it picks SGD itself.
        rate = schedules.SGD_LEARNING_RATE_AT_256 * math.sqrt(config.global_batch_size / 256)
        recipe = dataclasses.replace(
            recipe,
            optimizer="sgd",
            peak_learning_rate=rate,
            warmup_epochs=schedules.SGD_WARMUP_EPOCHS,
        )
    elif config.optimizer == "lars" and recipe.optimizer != "lars":
        reference = schedules.reference_lars_hparams(config.global_batch_size)
        recipe = dataclasses.replace(recipe, optimizer="lars", **reference)
    given = {
        name: getattr(config, name)
        for name in ("peak_learning_rate", "warmup_epochs", "weight_decay", "label_smoothing")
    }
    return dataclasses.replace(recipe, **{k: v for k, v in given.items() if v is not None})


def _build_model(config):
    import keras

    from tpu_scale import losses, models

    if config.model == "resnet50":
        model = models.resnet50(
            config.num_classes,
            bn_group_size=config.bn_group_size,
            input_shape=(config.image_size, config.image_size, 3),
            normalize_inputs=config.input_dtype == "uint8",
        )
    else:
        model = models.small_resnet(
            config.num_classes,
            image_size=config.image_size,
            bn_group_size=config.bn_group_size,
            normalize_inputs=config.input_dtype == "uint8",
        )
    recipe = _recipe(config)
    model.compile(
        optimizer=recipe.build_optimizer(config.steps_per_epoch, config.epochs),
        loss=losses.SmoothedSparseCategoricalCrossentropy(recipe.label_smoothing, from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="top_1")],
    )
    logging.info(
        "Model %s: %d parameters; %s, peak LR %.3g, warmup %.2f epochs",
        config.model,
        model.count_params(),
        recipe.optimizer,
        recipe.peak_learning_rate,
        min(recipe.warmup_epochs, 0.4 * config.epochs),
    )
    return model, recipe


def progress_callback(global_batch_size, num_replicas, epochs):
    """A Keras callback that logs one line per epoch and keeps the training rate.

    The line: epoch, images/s (total and per replica), training loss and top-1, validation top-1.
    Each epoch is timed from the end of its first step to the end of its last, so tracing and the
    input pipeline's warm-up do not count.
    """
    import keras

    class Progress(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.images, self.seconds = 0, 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self._step_ends = []
            self._began = time.perf_counter()
            self._first_epoch = getattr(self, "_first_epoch", epoch)

        def on_train_batch_end(self, batch, logs=None):
            self._step_ends.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            rate = None
            if len(self._step_ends) >= 2:
                images = (len(self._step_ends) - 1) * global_batch_size
                seconds = self._step_ends[-1] - self._step_ends[0]
            elif self._step_ends and epoch > self._first_epoch:
                # A one-step epoch, past the first (whose step traces the model): from its start.
                images, seconds = global_batch_size, self._step_ends[0] - self._began
            else:
                images, seconds = 0, 0.0
            if seconds > 0:
                self.images += images
                self.seconds += seconds
                rate = images / seconds
            logging.info(
                "epoch %d/%d: %s images/s (%s per replica), loss %.4f, top-1 %.4f, val top-1 %.4f",
                epoch + 1,
                epochs,
                _rate(rate),
                _rate(rate and rate / num_replicas, "%.1f"),
                logs.get("loss", float("nan")),
                logs.get("top_1", float("nan")),
                logs.get("val_top_1", float("nan")),
            )

        @property
        def images_per_second(self):
            """The rate over all timed steps; None when no step could be timed."""
            return self.images / self.seconds if self.seconds else None

    return Progress()


def _rate(value, form="%.0f"):
    return "n/a" if value is None else form % value


def keep_newest_callback(folder, keep):
    """A Keras callback that deletes all but the `keep` newest files of `folder` each epoch."""
    import keras
    import tensorflow as tf

    class KeepNewest(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if not tf.io.gfile.isdir(folder):
                return
            names = sorted(tf.io.gfile.listdir(folder))  # epoch_NNN...: sorted oldest first
            for name in names[:-keep] if keep > 0 else names:
                tf.io.gfile.remove(os.path.join(folder, name))

    return KeepNewest()


def _callbacks(config, strategy, progress, temporary):
    import keras

    from tpu_scale import checkpointing

    is_chief = _is_chief(strategy)
    # Every worker runs the callbacks (they may save collectively), but only the chief writes to
    # model_dir; the backup callback decides that itself, and every worker restores the chief's.
    out_dir = config.model_dir
    if not is_chief:
        out_dir = tempfile.mkdtemp(prefix="tpu_scale_worker_")
        temporary.append(out_dir)
    checkpoints = os.path.join(out_dir, "checkpoints")
    return [
        # Atomic saves; kept at the end, so that a larger --epochs continues a finished run. On
        # SIGTERM (a preemption notice) every worker saves at the same step and exits with
        # checkpointing.PREEMPTED_EXIT_CODE; the same command then resumes there.
        checkpointing.BackupAndRestore(
            os.path.join(config.model_dir, "backup"), delete_checkpoint=False
        ),
        progress,
        keras.callbacks.ModelCheckpoint(
            os.path.join(checkpoints, "epoch_{epoch:03d}.weights.h5"), save_weights_only=True
        ),
        keep_newest_callback(checkpoints, config.keep_checkpoints),
        keras.callbacks.TensorBoard(os.path.join(out_dir, "logs"), update_freq="epoch"),
    ]


def _is_chief(strategy):
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    return resolver.task_type == "chief" or (
        resolver.task_type == "worker"
        and resolver.task_id == 0
        and "chief" not in resolver.cluster_spec().as_dict()
    )


# --------------------------------------------------------------------------- the run

RUN_FILE = "run.json"
FINAL_MODEL = "final.keras"
# The settings a run started with, kept so that a resumed run can say what changed.
SETTINGS_FILE = "settings.json"
# What decides how a run trains: changed on resuming, the rest of the run trains differently.
_TRAINING_SETTINGS = (
    "data_dir",
    "tfds_name",
    "model",
    "image_size",
    "num_classes",
    "global_batch_size",
    "mixed_precision",
    "input_dtype",
    "num_cpu_replicas",
    "mesh_shape",
    "bn_group_size",
    "optimizer",
    "peak_learning_rate",
    "warmup_epochs",
    "weight_decay",
    "label_smoothing",
)


def _compare_settings(config, resuming, chief):
    """Keeps the settings a run starts with; on resuming, warns about every one that changed."""
    import tensorflow as tf

    path = os.path.join(config.model_dir, SETTINGS_FILE)
    now = {name: getattr(config, name) for name in _TRAINING_SETTINGS}
    if resuming and tf.io.gfile.exists(path):
        with tf.io.gfile.GFile(path) as f:
            before = json.load(f)
        changed = [
            f"--{name} {before[name]} -> {now[name]}"
            for name in _TRAINING_SETTINGS
            if name in before and before[name] != now[name]
        ]
        if changed:
            logging.warning(
                "Resuming a run that started with other settings: %s. The rest of the run trains "
                "with the new ones; give the old values to go on as it began.",
                ", ".join(changed),
            )
    elif not resuming and chief:
        tf.io.gfile.makedirs(config.model_dir)
        with tf.io.gfile.GFile(path, "w") as f:
            json.dump(now, f, indent=2)


def _finished_run(model_dir, epochs):
    """The record of a run in `model_dir` that already trained `epochs` or more, else None."""
    import tensorflow as tf

    path = os.path.join(model_dir, RUN_FILE)
    if not tf.io.gfile.exists(path):
        return None
    with tf.io.gfile.GFile(path) as f:
        record = json.load(f)
    return record if record.get("epochs", 0) >= epochs else None


def train(config, extra_callbacks=()):
    """Runs training and evaluation; returns a dict with `top_1`, `images_per_second`,
    `wall_seconds`.

    Also `model_dir` (None when it was a temporary folder, removed at the end), `outputs` (what was
    written where) and `model`. On a `model_dir` that holds a finished run of at least
    `config.epochs` epochs nothing is trained: the summary is that run's, with
    `finished_before=True`.
    """
    start = time.perf_counter()
    _check_config(config)
    import tpu_scale

    strategy = tpu_scale.create_strategy(
        config.tpu,
        num_cpu_replicas=config.num_cpu_replicas,
        mesh_shape=None if (config.tpu or os.environ.get("TF_CONFIG")) else _mesh_shape(config),
        gradient_reduction=config.gradient_reduction,
    )
    _check_config(config, strategy)
    if config.model_dir:
        finished = _finished_run(config.model_dir, config.epochs)
        if finished is not None:
            logging.info(
                "%s already holds a finished run of %d epochs (top-1 %.4f); nothing to train. "
                "Pass a "
                "larger --epochs to continue it, or another --model_dir for a new run.",
                config.model_dir,
                finished["epochs"],
                finished["top_1"],
            )
            # The finished run's own wall time (older records lack it: then this process's).
            return dict(
                {"wall_seconds": time.perf_counter() - start, **finished},
                finished_before=True,
                model=None,
            )

    import keras

    keras.utils.set_random_seed(config.seed)
    previous_policy = keras.mixed_precision.global_policy()
    if config.mixed_precision != "float32":
        keras.mixed_precision.set_global_policy(f"mixed_{config.mixed_precision}")
    temporary = []  # folders this run made for itself, removed at the end
    try:
        return _run(config, strategy, start, extra_callbacks, temporary)
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)
        for folder in temporary:
            shutil.rmtree(folder, ignore_errors=True)


class TrainingDiverged(RuntimeError):
    """The loss blew up; the message names the step and the flags to change."""


def _run(config, strategy, start, extra_callbacks, temporary):
    """Data, model, `fit` and the final evaluation, under the strategy and the precision policy."""
    from tpu_scale import checkpointing
    from tpu_scale.callbacks import AverageMovingStatistics, LossGuard

    config = dataclasses.replace(config)
    synthetic = not (config.data_dir or config.tfds_name)
    data_dir = config.data_dir
    if synthetic:
        data_dir, config.num_classes = _make_default_dataset(config)
        temporary.append(data_dir)
    keep_outputs = bool(config.model_dir)
    if not keep_outputs:
        config.model_dir = tempfile.mkdtemp(prefix="tpu_scale_run_")
        temporary.append(config.model_dir)
    # TPUs need static shapes: the last evaluation batch is padded there, and weighted out of the
    # compiled (weighted) metrics. Elsewhere it stays partial, so every metric a user compiles is
    # right.
    pad_eval = bool(config.tpu)
    train_input, eval_input, (train_examples, eval_examples) = _inputs(config, data_dir, pad_eval)
    config.steps_per_epoch = max(1, train_examples // config.global_batch_size)
    if not synthetic and config.steps_per_epoch * config.epochs < _FEW_STEPS:
        logging.warning(
            "%d epochs of %d steps (%d training images, global batch %d) are only %d steps: a "
            "small dataset learns more with more epochs (--epochs %d) or a smaller "
            "--global_batch_size.",
            config.epochs,
            config.steps_per_epoch,
            train_examples,
            config.global_batch_size,
            config.steps_per_epoch * config.epochs,
            math.ceil(_FEW_STEPS / config.steps_per_epoch),
        )
    # One input pipeline unless several hosts (TF_CONFIG) each run their own.
    pipelines = 2 if os.environ.get("TF_CONFIG") else 1
    validation_steps = (
        None
        if pad_eval
        else eval_steps(
            eval_examples, config.global_batch_size, strategy.num_replicas_in_sync, pipelines
        )
    )

    backup = checkpointing.latest_backup(os.path.join(config.model_dir, "backup"))
    initial_epoch = backup.epoch if backup else 0
    if backup:
        logging.info(
            "Resuming from the backup after epoch %d of %d%s (%s)",
            backup.epoch,
            config.epochs,
            f" and {backup.step} steps" if backup.step else "",
            backup.path,
        )
    if keep_outputs:
        _compare_settings(config, resuming=backup is not None, chief=_is_chief(strategy))
    # Whole epochs are skipped here; the backup callback drops the steps of a part-done one.
    steps_done = initial_epoch * config.steps_per_epoch if config.deterministic else 0

    def train_dataset(context):
        # A resumed deterministic run continues the same stream of batches where the interrupted run
        # stopped; each step took one batch from this pipeline for every replica it feeds.
        replicas_fed = context.num_replicas_in_sync // context.num_input_pipelines
        return train_input.dataset(context).skip(steps_done * replicas_fed)

    train_data = strategy.distribute_datasets_from_function(train_dataset)
    # Each evaluation is one pass over every example.
    eval_data = strategy.distribute_datasets_from_function(
        eval_dataset_fn(eval_input, validation_steps)
    )

    with strategy.scope():
        model, recipe = _build_model(config)
    progress = progress_callback(
        config.global_batch_size, strategy.num_replicas_in_sync, config.epochs
    )
    # Stops a diverging run (NaN, or the loss far above its start) at the last good weights and
    # names the flags that fix it.
    guard = LossGuard(
        learning_rate_flag="--peak_learning_rate",
        optimizer_flag="--optimizer",
        suggested_learning_rate=recipe.peak_learning_rate / 4,
    )
    # First: every replica on the same batch-norm statistics before each validation, each epoch's
    # checkpoints and the final evaluation and save, so the top-1 the run reports is the saved
    # model's.
    callbacks = (
        [AverageMovingStatistics(), guard]
        + _callbacks(config, strategy, progress, temporary)
        + list(extra_callbacks)
    )
    logging.info(
        "Training %d epochs x %d steps of %d images on %d replicas (mesh %s); model_dir %s",
        config.epochs,
        config.steps_per_epoch,
        config.global_batch_size,
        strategy.num_replicas_in_sync,
        "x".join(map(str, strategy.mesh.shape)),
        config.model_dir if keep_outputs else "a temporary folder (pass --model_dir to keep it)",
    )
    show_bar = sys.stdout.isatty() if config.progress is None else config.progress
    # A dead or frozen peer is reported by name, not as an aborted collective.
    with checkpointing.peer_failures_explained(strategy):
        model.fit(
            train_data,
            epochs=config.epochs,
            steps_per_epoch=config.steps_per_epoch,
            validation_data=eval_data,
            validation_steps=validation_steps,
            callbacks=callbacks,
            verbose=1 if show_bar else 0,
            shuffle=False,
        )  # the input pipeline shuffles
    if guard.stopped:
        raise TrainingDiverged(guard.message)
    results = model.evaluate(eval_data, steps=validation_steps, return_dict=True, verbose=0)
    rate = progress.images_per_second  # None when no step could be timed
    summary = {
        "top_1": float(results["top_1"]),
        "images_per_second": rate,
        "images_per_second_per_replica": rate and rate / strategy.num_replicas_in_sync,
        "wall_seconds": time.perf_counter() - start,
        "num_classes": config.num_classes,
        "epochs": config.epochs,
        "eval_examples": eval_examples,
        "model": model,
        "model_dir": config.model_dir if keep_outputs else None,
        "outputs": {},
    }
    if keep_outputs and _is_chief(strategy):
        summary["outputs"] = _save_outputs(config, model, summary)
    return summary


def _save_outputs(config, model, summary):
    """The final model and the run record in `model_dir`; returns what was written where."""
    import tensorflow as tf

    outputs = {
        "final model": os.path.join(config.model_dir, FINAL_MODEL),
        "checkpoints": os.path.join(config.model_dir, "checkpoints"),
        "backup": os.path.join(config.model_dir, "backup"),
        "TensorBoard logs": os.path.join(config.model_dir, "logs"),
        "run record": os.path.join(config.model_dir, RUN_FILE),
        "settings it started with": os.path.join(config.model_dir, SETTINGS_FILE),
    }
    model.save(outputs["final model"])
    record = {
        key: summary[key]
        for key in (
            "top_1",
            "images_per_second",
            "images_per_second_per_replica",
            "num_classes",
            "epochs",
            "eval_examples",
            "wall_seconds",
        )
    }
    record.update(model_dir=config.model_dir, outputs=outputs, config=dataclasses.asdict(config))
    with tf.io.gfile.GFile(outputs["run record"], "w") as f:
        json.dump(record, f, indent=2, default=str)
    return outputs


def summary_line(summary):
    return (
        f"top-1 {summary['top_1']:.4f} (chance {1 / summary['num_classes']:.4f}) | "
        f"{_rate(summary['images_per_second'])} images/s "
        f"({_rate(summary['images_per_second_per_replica'], '%.1f')} per "
        f"replica) | wall {summary['wall_seconds']:.0f} s"
    )


def outputs_lines(summary):
    """Where the run's outputs are, one line each (or why there are none)."""
    if not summary.get("model_dir"):
        return [
            "outputs: none kept (no --model_dir: the run wrote to a temporary folder, now removed)"
        ]
    return [f"{name}: {path}" for name, path in summary["outputs"].items()]


def main(argv):
    del argv
    config = TrainConfig(
        **{f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(TrainConfig)}
    )
    try:
        summary = train(config)
    except (ValueError, TrainingDiverged) as e:
        print(f"error: {e}", file=sys.stderr)  # once: absl's logging.error would repeat it
        return 2
    print(summary_line(summary))
    for line in outputs_lines(summary):
        print(line)
    return 0


if __name__ == "__main__":
    define_flags()
    logging.set_verbosity(logging.INFO)
    # TensorFlow's own INFO lines (one per reduction it traces) would drown the progress lines.
    import logging as python_logging

    python_logging.getLogger("tensorflow").setLevel(python_logging.WARNING)
    app.run(main)
