"""Trains a ResNet on ImageNet-layout data with the large-batch recipe, on a TPU pod, GPUs or this CPU.

`model.fit` under `tpu_scale.create_strategy`, with grouped batch norm, the 2-D torus gradient sum, the fused
decode-and-crop input pipeline, LARS with warmup + polynomial decay, label smoothing and (optionally) bfloat16.
Evaluates every epoch, logs images/s, writes TensorBoard logs and checkpoints to --model_dir, and resumes from
there after an interruption. Ends with one line: `top-1 <accuracy> | <images/s> | wall <seconds>`.

This CPU, the built-in default: generates a small learnable dataset of real JPEGs in TFRecords in a temporary
folder (nothing is downloaded) and trains a small ResNet on 8 virtual CPU replicas in a 2x4 mesh:

    python examples/train_imagenet.py

Your own images (a folder with one sub-folder of JPEGs per class):

    python -m tpu_scale.data.write_tfrecords --image_dir ~/flowers --output_dir /tmp/flowers --num_shards 8
    python examples/train_imagenet.py --data_dir /tmp/flowers --label_offset 0 --num_classes 5 \
        --image_size 128 --epochs 30 --model_dir /tmp/flowers_run

A Cloud TPU v3-8 (ImageNet in the classic layout: train-* and validation-* files):

    python examples/train_imagenet.py --tpu $TPU_NAME --data_dir gs://my-bucket/imagenet \
        --model resnet50 --image_size 224 --num_classes 1000 --global_batch_size 1024 --epochs 90 \
        --mixed_precision bfloat16 --model_dir gs://my-bucket/runs/v3-8

A v3-1024 pod slice, the paper's configuration (batch 32768 = 16 per core, LARS, BN groups of 4 cores =
span 64; the reference LR 34 and 12 warmup epochs come from the batch size):

    python examples/train_imagenet.py --tpu $TPU_NAME --data_dir gs://my-bucket/imagenet \
        --model resnet50 --image_size 224 --num_classes 1000 --global_batch_size 32768 --epochs 72 \
        --bn_group_size 4 --mixed_precision bfloat16 --model_dir gs://my-bucket/runs/v3-1024

Two GPU hosts (run on each host, with its own task index; rows of the mesh are the hosts):

    TF_CONFIG='{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 0}}' \
    python examples/train_imagenet.py --data_dir /data/imagenet --model resnet50 --image_size 224 \
        --num_classes 1000 --global_batch_size 512 --epochs 90 --mixed_precision float16 --model_dir /shared/run
"""

import dataclasses
import json
import os
import sys
import tempfile
import time
from typing import Optional

from absl import app, flags, logging

# TensorFlow's C++ INFO lines (one per cancelled receive when a pass over the evaluation data ends, one per
# start-up probe) would drown the progress lines; warnings and errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

# Runnable from a checkout without installing: the package sits next to this folder.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

IMAGENET_TRAIN_EXAMPLES = 1_281_167
IMAGENET_EVAL_EXAMPLES = 50_000


@dataclasses.dataclass
class TrainConfig:
    """Everything a run needs; the defaults are the CPU default run."""

    tpu: Optional[str] = None
    data_dir: Optional[str] = None
    tfds_name: Optional[str] = None
    tfds_data_dir: Optional[str] = None
    label_offset: int = 1
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
    optimizer: str = "lars"
    peak_learning_rate: Optional[float] = None
    warmup_epochs: Optional[float] = None
    weight_decay: float = 1e-4
    label_smoothing: float = 0.1
    model_dir: Optional[str] = None
    num_cpu_replicas: int = 8
    mesh_shape: Optional[str] = "2x4"
    deterministic: bool = False
    seed: int = 0
    # Synthetic default data: examples per split.
    synthetic_train_examples: int = 2560
    synthetic_eval_examples: int = 512


def define_flags():
    defaults = TrainConfig()
    kinds = {str: flags.DEFINE_string, int: flags.DEFINE_integer, float: flags.DEFINE_float,
             bool: flags.DEFINE_bool}
    helps = {
        "tpu": "TPU name or address, or 'local' on a TPU VM. Empty: GPUs, TF_CONFIG hosts, or the CPU.",
        "data_dir": "Folder of classic-layout TFRecords (train-*, validation-*). Empty: synthetic JPEGs.",
        "tfds_name": "A TFDS dataset (e.g. imagenet2012) instead of --data_dir.",
        "tfds_data_dir": "TFDS data directory.",
        "label_offset": "Subtracted from stored labels: 1 for the classic 1-based ImageNet files.",
        "num_classes": "Classes; default 1000 for real data, the synthetic count otherwise.",
        "train_examples": "Training examples per epoch; default: ImageNet's with 1000 classes, else counted.",
        "eval_examples": "Evaluation examples; default: ImageNet's with 1000 classes, else counted.",
        "image_size": "Image height and width.",
        "model": "resnet50 or small_resnet.",
        "global_batch_size": "Examples per step over all replicas; must divide evenly over the replicas.",
        "epochs": "Training epochs.",
        "bn_group_size": "Replicas per batch-norm group; empty: the smallest group spanning 64 examples.",
        "gradient_reduction": "torus (2-D torus sum) or native (TensorFlow's all-reduce).",
        "mixed_precision": "float32, bfloat16 (TPU, CPU) or float16 (GPU).",
        "optimizer": "lars or sgd (momentum 0.9).",
        "peak_learning_rate": "Peak learning rate; default: the reference for the batch size (LARS).",
        "warmup_epochs": "Warmup epochs; default: the reference for the batch size (LARS).",
        "weight_decay": "L2 weight decay (batch-norm parameters and biases excluded).",
        "label_smoothing": "Label smoothing.",
        "model_dir": "Checkpoints, TensorBoard logs and the backup used to resume. Default: a temporary dir.",
        "num_cpu_replicas": "Virtual CPU replicas when there is no accelerator (per worker with TF_CONFIG).",
        "mesh_shape": "ROWSxCOLS mesh of a single host's replicas, e.g. 2x4.",
        "deterministic": "Reproducible input order and crops (slower), for comparing runs.",
        "seed": "Random seed.",
        "synthetic_train_examples": "Training examples of the generated default dataset.",
        "synthetic_eval_examples": "Evaluation examples of the generated default dataset.",
    }
    for field in dataclasses.fields(TrainConfig):
        kind = field.type if field.type in kinds else (
            int if "int" in str(field.type) else float if "float" in str(field.type) else str)
        kinds[kind](field.name, getattr(defaults, field.name), helps[field.name])


# --------------------------------------------------------------------------- set-up


def _parse_mesh_shape(text):
    if not text:
        return None
    try:
        rows, cols = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mesh_shape={text!r} must look like ROWSxCOLS, e.g. 2x4.") from None
    return rows, cols


def _check_config(config, strategy=None):
    """Fails at start, with the fix, on flag combinations that cannot work."""
    if config.data_dir and config.tfds_name:
        raise ValueError("Give --data_dir or --tfds_name, not both.")
    if config.model not in ("resnet50", "small_resnet"):
        raise ValueError(f"--model={config.model!r}: choose resnet50 or small_resnet.")
    if config.optimizer not in ("lars", "sgd"):
        raise ValueError(f"--optimizer={config.optimizer!r}: choose lars or sgd.")
    if config.mixed_precision not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"--mixed_precision={config.mixed_precision!r}: choose float32, bfloat16 or float16.")
    if config.epochs < 1 or config.global_batch_size < 1:
        raise ValueError("--epochs and --global_batch_size must be at least 1.")
    if strategy is None:
        return
    replicas = strategy.num_replicas_in_sync
    if config.global_batch_size % replicas:
        raise ValueError(
            f"--global_batch_size={config.global_batch_size} does not divide over {replicas} replicas; use a "
            f"multiple of {replicas}, e.g. {replicas * max(1, config.global_batch_size // replicas)}."
        )
    if config.bn_group_size is not None:
        strategy.mesh.group_assignment(config.bn_group_size)  # raises with the valid sizes


def _make_default_dataset(config):
    from tpu_scale import data

    folder = tempfile.mkdtemp(prefix="tpu_scale_synthetic_")
    made = data.make_synthetic_imagenet(
        folder, num_classes=config.num_classes or 10, train_examples=config.synthetic_train_examples,
        eval_examples=config.synthetic_eval_examples, image_shape=(config.image_size, config.image_size),
        seed=config.seed)
    logging.info("Generated %d + %d synthetic JPEG examples in %s", config.synthetic_train_examples,
                 config.synthetic_eval_examples, folder)
    return folder, made["num_classes"]


def _count_records(pattern):
    import tensorflow as tf

    files = tf.io.gfile.glob(pattern)
    return sum(1 for _ in tf.data.TFRecordDataset(files)) if files else 0


def _inputs(config, data_dir):
    """The train and eval `ImageNetInput`s and their example counts."""
    from tpu_scale import data

    common = dict(global_batch_size=config.global_batch_size, image_size=config.image_size,
                  dtype="bfloat16" if config.mixed_precision == "bfloat16" else "float32")
    if config.tfds_name:
        train = data.ImageNetInput.from_tfds(config.tfds_name, "train", config.tfds_data_dir, is_training=True,
                                             deterministic=config.deterministic, seed=config.seed, **common)
        evaluation = data.ImageNetInput.from_tfds(config.tfds_name, "validation", config.tfds_data_dir,
                                                  is_training=False, pad_last_batch=True, **common)
        counts = _tfds_counts(config)
    else:
        train_pattern = os.path.join(data_dir, "train-*")
        eval_pattern = os.path.join(data_dir, "validation-*")
        train = data.ImageNetInput(train_pattern, is_training=True, label_offset=config.label_offset,
                                   deterministic=config.deterministic, seed=config.seed, **common)
        evaluation = data.ImageNetInput(eval_pattern, is_training=False, label_offset=config.label_offset,
                                        pad_last_batch=True, **common)
        counts = _file_counts(config, train_pattern, eval_pattern)
    return train, evaluation, counts


def _tfds_counts(config):
    import tensorflow_datasets as tfds

    info = tfds.builder(config.tfds_name, data_dir=config.tfds_data_dir).info
    return (config.train_examples or info.splits["train"].num_examples,
            config.eval_examples or info.splits["validation"].num_examples)


def _file_counts(config, train_pattern, eval_pattern):
    imagenet = config.num_classes == 1000 and not config.synthetic_data
    train = config.train_examples or (IMAGENET_TRAIN_EXAMPLES if imagenet else _count_records(train_pattern))
    evaluation = config.eval_examples or (IMAGENET_EVAL_EXAMPLES if imagenet else _count_records(eval_pattern))
    if train == 0:
        raise ValueError(f"No training records match {train_pattern}.")
    return train, evaluation


def _build_model(config):
    import keras
    from tpu_scale import losses, models, optimizers, schedules

    if config.model == "resnet50":
        model = models.resnet50(config.num_classes, bn_group_size=config.bn_group_size,
                                input_shape=(config.image_size, config.image_size, 3))
    else:
        model = models.small_resnet(config.num_classes, image_size=config.image_size,
                                    bn_group_size=config.bn_group_size)
    if config.optimizer == "lars":
        reference = schedules.reference_lars_hparams(config.global_batch_size)
        peak = config.peak_learning_rate or reference["peak_learning_rate"]
        warmup = reference["warmup_epochs"] if config.warmup_epochs is None else config.warmup_epochs
    else:
        # Goyal et al.: 0.1 per 256 examples.
        peak = config.peak_learning_rate or 0.1 * config.global_batch_size / 256
        warmup = 5.0 if config.warmup_epochs is None else config.warmup_epochs
    # A short run cannot warm up for longer than a fraction of itself.
    warmup = min(warmup, config.epochs / 4)
    schedule = schedules.WarmupPolynomialDecay.from_epochs(
        peak, warmup, config.epochs, config.steps_per_epoch)
    if config.optimizer == "lars":
        optimizer = optimizers.LARS(schedule, momentum=0.9, weight_decay=config.weight_decay)
    else:
        optimizer = keras.optimizers.SGD(schedule, momentum=0.9, nesterov=True)
    model.compile(
        optimizer=optimizer,
        loss=losses.SmoothedSparseCategoricalCrossentropy(config.label_smoothing, from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="top_1")],
    )
    logging.info("Model %s: %d parameters, peak LR %.3g, warmup %.2f epochs", config.model,
                 model.count_params(), peak, warmup)
    return model


def throughput_callback(global_batch_size, num_replicas):
    """A Keras callback that logs images/s per epoch (total and per replica) and keeps the training rate.

    Each epoch is timed from the end of its first step to the end of its last, so tracing and the input
    pipeline's warm-up do not count.
    """
    import keras

    class Throughput(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.images, self.seconds = 0, 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self._step_ends = []

        def on_train_batch_end(self, batch, logs=None):
            self._step_ends.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            logs = logs or {}
            if len(self._step_ends) < 2:
                return
            images = (len(self._step_ends) - 1) * global_batch_size
            seconds = self._step_ends[-1] - self._step_ends[0]
            self.images += images
            self.seconds += seconds
            logging.info("epoch %d: %.0f images/s (%.1f per replica), loss %.4f, val top-1 %.4f", epoch + 1,
                         images / seconds, images / seconds / num_replicas, logs.get("loss", float("nan")),
                         logs.get("val_top_1", float("nan")))

        @property
        def images_per_second(self):
            return self.images / self.seconds if self.seconds else float("nan")

    return Throughput()


def _initial_epoch(backup_dir):
    """The epoch a backup in `backup_dir` resumes from (0 without one)."""
    import tensorflow as tf

    path = os.path.join(backup_dir, "training_metadata.json")
    if not tf.io.gfile.exists(path):
        return 0
    with tf.io.gfile.GFile(path) as f:
        return int(json.load(f).get("epoch", 0))


def _callbacks(config, strategy, throughput):
    import keras

    is_chief = _is_chief(strategy)
    # Every worker runs the callbacks (they may save collectively), but only the chief writes to model_dir.
    out_dir = config.model_dir if is_chief else tempfile.mkdtemp(prefix="tpu_scale_worker_")
    return [
        throughput,
        keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")),
        keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "checkpoints", "epoch_{epoch:03d}.weights.h5"),
                                        save_weights_only=True),
        keras.callbacks.TensorBoard(os.path.join(out_dir, "logs"), update_freq="epoch"),
    ]


def _is_chief(strategy):
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.cluster_spec().as_dict():
        return True
    return resolver.task_type == "chief" or (resolver.task_type == "worker" and resolver.task_id == 0
                                             and "chief" not in resolver.cluster_spec().as_dict())


# --------------------------------------------------------------------------- the run


def train(config, extra_callbacks=()):
    """Runs training and evaluation; returns a dict with `top_1`, `images_per_second`, `wall_seconds`."""
    start = time.perf_counter()
    _check_config(config)
    import tpu_scale

    strategy = tpu_scale.create_strategy(
        config.tpu, num_cpu_replicas=config.num_cpu_replicas,
        mesh_shape=None if (config.tpu or os.environ.get("TF_CONFIG")) else _parse_mesh_shape(config.mesh_shape),
        gradient_reduction=config.gradient_reduction)
    _check_config(config, strategy)

    import keras

    keras.utils.set_random_seed(config.seed)
    previous_policy = keras.mixed_precision.global_policy()
    if config.mixed_precision != "float32":
        keras.mixed_precision.set_global_policy(f"mixed_{config.mixed_precision}")
    try:
        return _run(config, strategy, start, extra_callbacks)
    finally:
        keras.mixed_precision.set_global_policy(previous_policy)


def _run(config, strategy, start, extra_callbacks):
    """Data, model, `fit` and the final evaluation, under the strategy and the precision policy."""
    config = dataclasses.replace(config)
    config.synthetic_data = not (config.data_dir or config.tfds_name)
    data_dir = config.data_dir
    if config.synthetic_data:
        data_dir, config.num_classes = _make_default_dataset(config)
    config.num_classes = config.num_classes or 1000
    config.model_dir = config.model_dir or tempfile.mkdtemp(prefix="tpu_scale_run_")
    train_input, eval_input, (train_examples, eval_examples) = _inputs(config, data_dir)
    config.steps_per_epoch = max(1, train_examples // config.global_batch_size)

    initial_epoch = _initial_epoch(os.path.join(config.model_dir, "backup"))
    steps_done = initial_epoch * config.steps_per_epoch if config.deterministic else 0

    def train_dataset(context):
        # A resumed deterministic run continues the same stream of batches where the interrupted run stopped;
        # each step took one batch from this pipeline for every replica it feeds.
        replicas_fed = context.num_replicas_in_sync // context.num_input_pipelines
        return train_input.dataset(context).skip(steps_done * replicas_fed)

    train_data = strategy.distribute_datasets_from_function(train_dataset)
    # Finite: each evaluation is one pass over every example, the padding weighted out.
    eval_data = strategy.distribute_datasets_from_function(eval_input.dataset)

    with strategy.scope():
        model = _build_model(config)
    throughput = throughput_callback(config.global_batch_size, strategy.num_replicas_in_sync)
    callbacks = _callbacks(config, strategy, throughput) + list(extra_callbacks)
    logging.info("Training %d epochs x %d steps of %d images on %d replicas (mesh %s); model_dir %s",
                 config.epochs, config.steps_per_epoch, config.global_batch_size, strategy.num_replicas_in_sync,
                 "x".join(map(str, strategy.mesh.shape)), config.model_dir)
    model.fit(train_data, epochs=config.epochs, steps_per_epoch=config.steps_per_epoch,
              validation_data=eval_data, callbacks=callbacks, verbose=0)
    results = model.evaluate(eval_data, return_dict=True, verbose=0)
    summary = {
        "top_1": float(results["top_1"]),
        "images_per_second": throughput.images_per_second,
        "images_per_second_per_replica": throughput.images_per_second / strategy.num_replicas_in_sync,
        "wall_seconds": time.perf_counter() - start,
        "num_classes": config.num_classes,
        "model": model,
        "model_dir": config.model_dir,
    }
    return summary


def summary_line(summary):
    return (f"top-1 {summary['top_1']:.4f} (chance {1 / summary['num_classes']:.4f}) | "
            f"{summary['images_per_second']:.0f} images/s ({summary['images_per_second_per_replica']:.1f} per "
            f"replica) | wall {summary['wall_seconds']:.0f} s")


def main(argv):
    del argv
    config = TrainConfig(**{f.name: flags.FLAGS[f.name].value for f in dataclasses.fields(TrainConfig)})
    try:
        summary = train(config)
    except ValueError as e:
        logging.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary_line(summary))
    return 0


if __name__ == "__main__":
    define_flags()
    logging.set_verbosity(logging.INFO)
    # TensorFlow's own INFO lines (one per reduction it traces) would drown the progress lines.
    import logging as python_logging
    python_logging.getLogger("tensorflow").setLevel(python_logging.WARNING)
    app.run(main)
