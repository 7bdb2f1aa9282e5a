"""Trains a ResNet on ImageNet-layout records with the large-batch recipe: TPU pod, GPUs or CPU.

`model.fit` under `tpu_scale.create_strategy` with grouped batch norm, the 2-D torus gradient sum,
the fused decode-and-crop input and the recipe for the batch (`recipe.recipe_for_batch`). Every
epoch evaluates each validation example once; a diverging run backs off; it ends with one line,
`top-1 <accuracy> | <images/s> | wall <seconds>`, and where every output is.

This CPU, the built-in default: generates a small learnable dataset of real JPEGs in a temporary
folder (nothing is downloaded) and trains a small ResNet on 8 virtual CPU replicas in a 2x4 mesh:

    python examples/train_imagenet.py

Your own images (one sub-folder of images per class), converted once to records in the run's
folder with a validation split and a label map; on a CPU host it trains on one replica:

    python examples/train_imagenet.py --image_dir ~/flowers --model_dir ~/flowers_run

--model_dir keeps the run (checkpoints, TensorBoard logs, backups, final.keras, run.json); the same
command resumes it, naming every setting that changed; a SIGTERM makes every worker save and exit
(code 143). Without --model_dir nothing is written.

A Cloud TPU with ImageNet (train-* and validation-* files), the paper's v3-1024 setup: batch 32768
= 16 per core, LARS (rate and warmup from the batch), BN groups of 4 cores = span 64; a v3-8 takes
--global_batch_size 1024 --epochs 90:

    python examples/train_imagenet.py --tpu $TPU_NAME --data_dir gs://my-bucket/imagenet \
        --model resnet50 --image_size 224 --global_batch_size 32768 --epochs 72 \
        --bn_group_size 4 --mixed_precision bfloat16 --model_dir gs://my-bucket/runs/v3-1024

Several hosts run the same command with a --model_dir they all read; create_strategy finds the
cluster in TF_CONFIG (examples/kubernetes/) or a Slurm step (examples/slurm/). Two workers here:

    python -m tpu_scale.launch --num_workers 2 -- examples/train_imagenet.py \
        --num_cpu_replicas 2 --epochs 2 --model_dir /tmp/two_workers
"""

import contextlib
import dataclasses
import logging as python_logging
import os
import shutil
import sys
import tempfile
import time
from typing import Optional

from absl import app, flags, logging

# TensorFlow's C++ INFO and WARNING lines would drown the progress lines; errors still show.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Runnable from a checkout without installing: the package sits next to this folder.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tpu_scale  # noqa: E402
from tpu_scale import callbacks, checkpointing, data, losses, models, plan, training  # noqa: E402
from tpu_scale.distribute.mesh import parse_mesh_shape, smallest_group_for_span  # noqa: E402
from tpu_scale.recipe import recipe_for_batch  # noqa: E402


def flag(default, text):
    return dataclasses.field(default=default, metadata={"help": text})


@dataclasses.dataclass
class TrainConfig:
    """The run's settings, one per command-line flag; the defaults are the CPU default run."""

    tpu: Optional[str] = flag(None, "TPU name or address, or 'local' on a TPU VM.")
    image_dir: Optional[str] = flag(None, "Folder of class folders of images (converted once).")
    data_dir: Optional[str] = flag(None, "Folder of TFRecords (train-*, validation-*).")
    tfds_name: Optional[str] = flag(None, "A TFDS dataset (e.g. imagenet2012) instead.")
    tfds_data_dir: Optional[str] = flag(None, "TFDS data directory.")
    num_classes: Optional[int] = flag(None, "Classes. Default: the label map's, or 1000.")
    label_offset: Optional[int] = flag(None, "Stored label of class 0. Default: label map's, or 1.")
    train_examples: Optional[int] = flag(None, "Training examples per epoch. Default: counted.")
    validation_examples: Optional[int] = flag(None, "Validation examples. Default: counted.")
    image_size: int = flag(64, "Image height and width.")
    model: str = flag("small_resnet", "resnet50 or small_resnet.")
    global_batch_size: int = flag(128, "Examples per step over all replicas.")
    epochs: int = flag(6, "Training epochs.")
    bn_group_size: Optional[int] = flag(None, "Replicas per BN group. Default: span 64 examples.")
    bn_virtual_batch_size: int = flag(0, "Examples per BN virtual batch in a replica. 0: all.")
    gradient_accumulation_steps: int = flag(1, "Micro-batches per update (effective batch x k).")
    weight_update_sharding: bool = flag(False, "Each replica updates 1/N of the weights.")
    gradient_reduction: str = flag("torus", "torus (2-D torus sum) or native (TensorFlow's).")
    mixed_precision: str = flag("float32", "float32, bfloat16 (TPU, CPU) or float16 (GPU).")
    input_dtype: str = flag("float", "float (host normalizes) or uint8 (the model normalizes).")
    optimizer: Optional[str] = flag(None, "lars or sgd. Default: the recipe's for the batch.")
    augmentation: str = flag("auto", "auto, none, translate, shift, light or imagenet. Default: by data.")
    aspect_ratio: Optional[str] = flag(None, "stretch, pad or crop: a non-square image's fit. Default: the level's.")
    peak_learning_rate: Optional[float] = flag(None, "Peak learning rate. Default: the recipe's.")
    warmup_epochs: Optional[float] = flag(None, "Warmup epochs. Default: the recipe's.")
    weight_decay: Optional[float] = flag(None, "Weight decay. Default: the recipe's, by data size.")
    label_smoothing: Optional[float] = flag(None, "Label smoothing. Default: the recipe's.")
    ema_momentum: Optional[float] = flag(None, "Weight average evaluated (0: none). Default: recipe's.")
    model_dir: Optional[str] = flag(None, "The run's folder (resume, outputs). Empty: none kept.")
    num_cpu_replicas: Optional[int] = flag(None, "CPU replicas. Default: 8 (generated data), 1.")
    mesh_shape: Optional[str] = flag(None, "ROWSxCOLS of one host's replicas. Default: squarest.")
    strict: bool = flag(False, "Stop at the first bad record (default: skip, name and count).")
    max_bad_fraction: float = flag(0.001, "Stop when more of the records read are bad (and 10+).")
    deterministic: bool = flag(False, "Reproducible input order and crops (slower).")
    cache_validation: str = flag("auto", "auto, yes or no: validation in memory. auto: if small.")
    seed: int = flag(0, "Random seed.")
    progress: Optional[bool] = flag(None, "Keras progress bar. Default: on in a terminal.")
    keep_checkpoints: int = flag(3, "The newest per-epoch checkpoints kept.")
    synthetic_train_examples: int = flag(2560, "Training examples of the generated dataset.")
    synthetic_validation_examples: int = flag(512, "Validation examples of the generated dataset.")


# What decides how a run trains: a resumed run names each of these that changed.
TRAINING_SETTINGS = (
    "image_dir data_dir tfds_name model image_size num_classes global_batch_size mixed_precision "
    "input_dtype num_cpu_replicas mesh_shape bn_group_size bn_virtual_batch_size optimizer augmentation aspect_ratio "
    "gradient_accumulation_steps weight_update_sharding "
    "peak_learning_rate warmup_epochs weight_decay label_smoothing ema_momentum"
).split()


IMAGE_DIR_ON_ONE_HOST = "--image_dir converts the images on this host; for a TPU or several workers convert them once (python -m tpu_scale.data.convert) and pass --data_dir."


class TrainingDiverged(RuntimeError):
    """The loss blew up and backing off did not help; the message names the flags to change."""


def check_flags(config):
    """Fails at start, with the fix, on flags that cannot work."""
    for name, allowed in [
        ("model", "resnet50 small_resnet"),
        ("optimizer", "lars sgd"),
        ("mixed_precision", "float32 bfloat16 float16"),
        ("input_dtype", "uint8 float"),
        ("aspect_ratio", "stretch pad crop"),
        ("cache_validation", "auto yes no"),
    ]:
        value = getattr(config, name)
        if value not in allowed.split() and not (name in ("optimizer", "aspect_ratio") and value is None):
            raise ValueError(f"--{name}={value!r}: choose {' or '.join(allowed.split())}.")
    if sum(bool(v) for v in (config.image_dir, config.data_dir, config.tfds_name)) > 1:
        raise ValueError("Give one of --image_dir, --data_dir and --tfds_name.")
    if config.image_dir and config.tpu:
        raise ValueError(IMAGE_DIR_ON_ONE_HOST)
    counts = "epochs global_batch_size num_cpu_replicas gradient_accumulation_steps".split()
    for name, value in ((name, getattr(config, name)) for name in counts):
        if value is not None and value < 1:
            raise ValueError(f"--{name}={value}: it must be at least 1.")
    if config.bn_virtual_batch_size < 0:
        raise ValueError(f"--bn_virtual_batch_size={config.bn_virtual_batch_size}: give 0 (the replica's whole batch) or the examples per virtual batch, e.g. 64.")
    if config.ema_momentum is not None and not 0 <= config.ema_momentum < 1:
        raise ValueError(f"--ema_momentum={config.ema_momentum}: give 0 (no average) or a momentum below 1, e.g. 0.9.")


def train(config, extra_callbacks=()):
    """Trains and evaluates; returns the summary (`top_1`, `images_per_second`, ...)."""
    start = time.perf_counter()
    config = dataclasses.replace(config)
    check_flags(config)
    synthetic = not (config.image_dir or config.data_dir or config.tfds_name)
    if config.num_cpu_replicas is None:
        # The generated data show the 2x4 mesh; on a user's data one replica trains fastest on a
        # CPU host, where TensorFlow already spreads each operation over the cores.
        config.num_cpu_replicas = 8 if synthetic else 1

    # ---- strategy: the hardware and its replica mesh (one host's replicas in the squarest grid
    # or --mesh_shape; several workers are workers x local replicas; a TPU follows its torus)
    mesh_shape = config.mesh_shape and parse_mesh_shape(config.mesh_shape, config.num_cpu_replicas)
    strategy = tpu_scale.create_strategy(
        config.tpu,
        num_cpu_replicas=config.num_cpu_replicas,
        mesh_shape=mesh_shape or "squarest",
        gradient_reduction=config.gradient_reduction,
    )
    replicas, mesh = strategy.num_replicas_in_sync, strategy.mesh
    if config.image_dir and not isinstance(strategy, tf.distribute.MirroredStrategy):
        raise ValueError(IMAGE_DIR_ON_ONE_HOST)

    per_replica = max(1, config.global_batch_size // replicas)
    if config.bn_group_size is None:
        # The smallest group spanning 64 examples, chosen here: under several workers the layers
        # see no static batch size to choose it from.
        config.bn_group_size = smallest_group_for_span(mesh, per_replica, tiled=mesh.is_torus)
    mesh.group_assignment(config.bn_group_size)  # raises with the valid sizes
    if config.model_dir and (finished := training.finished_run(config.model_dir, config.epochs)):
        logging.info(training.finished_message(config.model_dir, finished))
        return dict(finished, finished_before=True, model=None)

    with contextlib.ExitStack() as cleanup:
        cleanup.callback(keras.mixed_precision.set_global_policy, keras.mixed_precision.global_policy())
        if config.mixed_precision != "float32":
            keras.mixed_precision.set_global_policy(f"mixed_{config.mixed_precision}")
        keras.utils.set_random_seed(config.seed)
        model_dir = config.model_dir or tempfile.mkdtemp(prefix="tpu_scale_run_")
        if not config.model_dir:
            cleanup.callback(shutil.rmtree, model_dir, ignore_errors=True)
        # One run at a time in a folder: a second would delete the first's backups.
        cleanup.enter_context(training.folder_lock(model_dir, strategy))

        # ---- data: records, a user's images (converted once, into the run's folder), a TFDS
        # dataset, or generated; with their counts and the exact evaluation
        source = config.image_dir or config.data_dir or f"tfds:{config.tfds_name}"
        if synthetic:
            source = tempfile.mkdtemp(prefix="tpu_scale_synthetic_")
            cleanup.callback(shutil.rmtree, source, ignore_errors=True)
            data.make_synthetic_imagenet(
                source,
                num_classes=config.num_classes or 10,
                train_examples=config.synthetic_train_examples,
                validation_examples=config.synthetic_validation_examples,
                image_shape=(config.image_size, config.image_size),
                seed=config.seed,
            )
        # The host sends raw pixels (uint8), or images normalized in the model's precision.
        dtype = "bfloat16" if config.mixed_precision == "bfloat16" else "float32"
        dtype = "uint8" if config.input_dtype == "uint8" else dtype
        settings = "deterministic seed strict max_bad_fraction".split()
        input_config = data.InputConfig(
            **{name: getattr(config, name) for name in settings},
            cache_validation={"auto": None, "yes": True, "no": False}[config.cache_validation],
        )
        given = "image_size global_batch_size num_classes label_offset train_examples tfds_data_dir"
        inputs = data.inputs(
            source,
            strategy=strategy,
            config=input_config,
            dtype=dtype,
            validation_examples=config.validation_examples,
            records_dir=os.path.join(model_dir, "records"),
            **{name: getattr(config, name) for name in given.split()},
        )
        steps = inputs.steps_per_epoch()
        if not synthetic and (hint := training.short_run_hint(steps, config.epochs)):
            logging.warning(hint)

        # ---- recipe for this batch and dataset (with accumulation: the effective batch's)
        accumulate = config.gradient_accumulation_steps
        recipe = recipe_for_batch(
            config.global_batch_size * accumulate,
            config.epochs,
            steps_per_epoch=max(1, steps // accumulate),
            train_examples=inputs.train_examples,
            image_size=config.image_size,
            num_classes=inputs.num_classes,
            optimizer=config.optimizer,
            augmentation=config.augmentation,
            # The writer counts the images that are not square; the recipe's augmentation reads it.
            non_square_fraction=inputs.label_map and inputs.label_map.non_square_fraction,
        )
        given = "peak_learning_rate warmup_epochs weight_decay label_smoothing ema_momentum aspect_ratio".split()
        recipe = recipe.with_settings(**{k: getattr(config, k) for k in given})
        if accumulate > 1 and config.ema_momentum is None:
            # Keras keeps no moving average of the weights with accumulation under a strategy.
            recipe = recipe.with_settings(ema_momentum=0.0)
        inputs = inputs.with_config(recipe.input_config(input_config))  # its crops and flips
        # Raises, with the fix, if the global batch does not divide over the replicas. A small
        # validation set is decoded once and kept in memory (data.exact_evaluation's rule).
        validation = inputs.exact_evaluation

        # ---- model: grouped batch norm, compiled with the recipe
        with strategy.scope():
            size = config.image_size
            model = getattr(models, config.model)(
                inputs.num_classes,
                input_shape=(size, size, 3),
                bn_group_size=config.bn_group_size,
                bn_virtual_batch_size=config.bn_virtual_batch_size or None,
                normalize_inputs=config.input_dtype == "uint8",  # uint8 pixels in, normalized here
            )
            # The schedule counts fit steps (micro-batches), as Keras's accumulation does.
            optimizer = recipe.build_optimizer(
                steps,
                config.epochs,
                weight_update_sharding=config.weight_update_sharding,
                gradient_accumulation_steps=accumulate if accumulate > 1 else None,
            )
            loss = losses.SmoothedSparseCategoricalCrossentropy(recipe.label_smoothing, from_logits=True)
            top_1 = keras.metrics.SparseCategoricalAccuracy(name="top_1")
            model.compile(optimizer=optimizer, loss=loss, weighted_metrics=[top_1])
        logging.info(f"{config.model}: {model.count_params()} parameters; {recipe.describe()}")
        if config.augmentation == "auto" and recipe.augmentation == "shift":
            logging.info(f"Augmentation shift, not none: {inputs.label_map.non_square_fraction:.0%} of the images are not square (recipe.default_augmentation).")
        if not config.weight_update_sharding and (advice := plan.sharding_advice(strategy, model)):
            logging.info(advice)

        # ---- callbacks: backups, preemption, checkpoints, TensorBoard, statistics, guard
        guard = callbacks.LossGuard(learning_rate_flag="--peak_learning_rate", optimizer_flag="--optimizer")
        run_callbacks = [callbacks.AverageMovingStatistics(), guard]
        if config.model_dir:
            run_callbacks = training.run_callbacks(
                model_dir, strategy, keep_checkpoints=config.keep_checkpoints, loss_guard=guard
            )
            training.resuming_from(model_dir, config.epochs)
            training.record_settings(
                model_dir, {k: getattr(config, k) for k in TRAINING_SETTINGS}, strategy
            )
        logger = training.EpochLogger(config.global_batch_size, replicas, config.epochs)
        skipped = data.SkippedRecordsLogger(inputs.train, inputs.validation)  # bad records

        # ---- fit, then one more exact evaluation of the final model
        logging.info(f"Training {config.epochs} epochs x {steps} steps of {config.global_batch_size} images (effective batch {config.global_batch_size * accumulate}) on {replicas} replicas (mesh {'x'.join(map(str, mesh.shape))}); batch norm over {config.bn_virtual_batch_size or per_replica * config.bn_group_size} examples; model_dir {config.model_dir or 'none'}")
        show_bar = sys.stdout.isatty() if config.progress is None else config.progress
        with checkpointing.peer_failures_explained(strategy):
            model.fit(
                training.train_dataset(strategy, inputs.train, model_dir, steps),
                epochs=config.epochs,
                steps_per_epoch=steps,
                validation_data=validation.dataset,
                validation_steps=validation.steps,
                # The recipe's: fit's validation sees the averaged weights, if the recipe averages.
                callbacks=run_callbacks + recipe.callbacks() + [logger, skipped, *extra_callbacks],
                verbose=1 if show_bar else 0,
                shuffle=False,  # the input pipeline shuffles
            )
        if guard.stopped:
            raise TrainingDiverged(guard.message)
        results = model.evaluate(validation.dataset, steps=validation.steps, return_dict=True, verbose=0)
        # Every pass reads every validation record: the bad ones, each counted once.
        validation_skipped = inputs.validation.distinct_skipped_records

        # ---- report
        rate = logger.images_per_second
        summary = {
            "top_1": float(results["top_1"]),
            "images_per_second": rate,
            "images_per_second_per_replica": rate and rate / replicas,
            "wall_seconds": time.perf_counter() - start,
            "num_classes": inputs.num_classes,
            "epochs": config.epochs,
            "validation_examples": inputs.validation_examples,
            "validation_skipped": validation_skipped,
        }
        outputs = None
        if config.model_dir:
            record = dict(summary, config=dataclasses.asdict(config))
            record["input_config"] = inputs.config.to_dict()  # data.InputConfig.from_dict reads it
            outputs = training.save_run(model_dir, model, record, strategy)
        return dict(summary, model=model, model_dir=config.model_dir, outputs=outputs)


# Flags that "validation" renamed (the data split; "evaluation" is the act): an old spelling is
# refused with the new one, not with absl's unknown-flag error.
RENAMED_FLAGS = {
    "eval_examples": "validation_examples",
    "cache_evaluation": "cache_validation",
    "synthetic_eval_examples": "synthetic_validation_examples",
}


def check_renamed_flags(argv):
    """Raises `SystemExit` naming the new flag for any renamed flag in `argv`."""
    for arg in argv[1:]:
        name = arg.lstrip("-").split("=")[0]
        if arg.startswith("-") and name in RENAMED_FLAGS:
            raise SystemExit(f"error: --{name} is now --{RENAMED_FLAGS[name]}.")


def main(argv):
    del argv
    fields = dataclasses.fields(TrainConfig)
    config = TrainConfig(**{f.name: flags.FLAGS[f.name].value for f in fields})
    # Two process-wide settings for TensorFlow's sake, asked for by name (tpu_scale.process): the
    # BFC allocator keeps a step's buffers for the next, and a tf.data iterator's deletion (each
    # evaluation's) seldom stalls.
    tpu_scale.process.use_bfc_cpu_allocator()
    tpu_scale.process.avoid_iterator_stalls()
    try:
        summary = train(config)
    except (ValueError, TrainingDiverged, training.FolderBusy, training.FinalSaveError, checkpointing.BackupWriteError) as e:
        print(f"error: {e}", file=sys.stderr)  # once: absl's logging.error would repeat it
        return 2
    print(training.summary_line(summary))
    print("\n".join(training.outputs_lines(summary.get("outputs"))))
    return 0


if __name__ == "__main__":
    kinds = {int: flags.DEFINE_integer, float: flags.DEFINE_float, bool: flags.DEFINE_bool}
    for field in dataclasses.fields(TrainConfig):
        kind = next((k for k in kinds if k.__name__ in str(field.type)), str)
        kinds.get(kind, flags.DEFINE_string)(field.name, field.default, field.metadata["help"])
    check_renamed_flags(sys.argv)
    logging.set_verbosity(logging.INFO)
    # The package's progress lines (Python loggers under "tpu_scale"), not TensorFlow's INFO lines.
    python_logging.getLogger("tpu_scale").setLevel(python_logging.INFO)
    python_logging.getLogger("tensorflow").setLevel(python_logging.WARNING)
    app.run(main)
