"""Tests of the input builder (`tpu_scale.data`).

Most tests read "coded" records: each image is a flat colour whose red channel encodes its label and
whose green and blue channels encode a unique example id. Flat colours survive JPEG, cropping and
resizing, so every output image can be traced back to its record, and counts, pairing with labels
and sharding are checked exactly.
"""

import dataclasses
import os

import numpy as np
import pytest
import tensorflow as tf
from synthetic_input import SyntheticImageNetInput  # a test helper, beside the tests

import tpu_scale.distribute.strategy  # its MirroredStrategy has private collective keys: tests share a process
from tpu_scale import data
from tpu_scale.data import (
    ImageNetInput,
    InputConfig,
    image_ops,
    make_synthetic_imagenet,
)
from tpu_scale.data.input_config import FIELDS
from tpu_scale.data.input_pipeline import RECORDS_PER_CALL
from tpu_scale.data.schema import make_example, read_label_map

NUM_CLASSES = 5
STEP = 8  # colour levels per code unit: JPEG errors on flat colours stay well below STEP / 2
IMAGE_SIZE = 8


def coded_jpeg(example_id, label, height, width):
    colour = [STEP * label, STEP * (example_id % 32), STEP * (example_id // 32)]
    image = np.full((height, width, 3), colour, np.uint8)
    return tf.io.encode_jpeg(image, quality=95).numpy()


def write_coded_records(directory, num_files, per_file, *, first_id=0, bad=None, label_base=1):
    """Writes `num_files` TFRecord files of coded examples; `bad` maps ids to broken bytes."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(first_id)
    expected = {}
    example_id = first_id
    for file_index in range(num_files):
        path = os.path.join(directory, f"train-{file_index:05d}-of-{num_files:05d}")
        with tf.io.TFRecordWriter(path) as writer:
            for _ in range(per_file):
                label = example_id % NUM_CLASSES
                height, width = rng.integers(16, 48, size=2)
                jpeg = coded_jpeg(example_id, label, height, width)
                if bad and example_id in bad:
                    jpeg = bad[example_id](jpeg)
                else:
                    expected[example_id] = label
                writer.write(
                    make_example(
                        jpeg, label + label_base, height=height, width=width
                    ).SerializeToString()
                )
                example_id += 1
    return os.path.join(directory, "train-*"), expected


def decode_codes(images):
    """(label, example id) of each image of a normalized batch."""
    pixels = (
        images.numpy().astype(np.float32) * image_ops.IMAGENET_STDDEV_RGB
        + image_ops.IMAGENET_MEAN_RGB
    )
    codes = np.rint(pixels.mean(axis=(1, 2)) / STEP).astype(int)
    return codes[:, 0], codes[:, 1] + 32 * codes[:, 2]


def collect(dataset, num_batches=None):
    """Example ids and labels of a dataset's batches, checking each image against its label."""
    ids, labels, sizes = [], [], []
    for batch in dataset.take(num_batches) if num_batches else dataset:
        images, batch_labels = batch[0], batch[1].numpy()
        coded_labels, batch_ids = decode_codes(images)
        np.testing.assert_array_equal(
            coded_labels, batch_labels
        )  # every image carries its own label
        ids.extend(batch_ids.tolist())
        labels.extend(batch_labels.tolist())
        sizes.append(len(batch_labels))
    return ids, labels, sizes


def context(index, count, replicas=None):
    return tf.distribute.InputContext(
        num_input_pipelines=count, input_pipeline_id=index, num_replicas_in_sync=replicas or count
    )


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """4 files of 15 coded examples."""
    return write_coded_records(str(tmp_path_factory.mktemp("coded")), num_files=4, per_file=15)


def make_input(pattern, **kwargs):
    """An `ImageNetInput`, given its arguments and its configuration's fields together."""
    kwargs.setdefault("image_size", IMAGE_SIZE)
    settings = {name: kwargs.pop(name) for name in list(kwargs) if name in FIELDS}
    return ImageNetInput(pattern, config=InputConfig(**settings), **kwargs)


def test_a_setting_passed_as_before_names_its_new_home(records):
    with pytest.raises(TypeError, match=r"Pass config=InputConfig\(cache=True, seed=3\)\."):
        ImageNetInput(records[0], is_training=True, global_batch_size=4, cache=True, seed=3)
    config = InputConfig(deterministic=True)
    with pytest.raises(TypeError, match=r"Pass config=config\.replace\(strict=True\)\."):
        ImageNetInput(records[0], is_training=True, global_batch_size=4, config=config, strict=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'shuffle'"):
        ImageNetInput(records[0], is_training=True, global_batch_size=4, shuffle=True)
    with pytest.raises(TypeError, match="must be an InputConfig"):
        ImageNetInput(records[0], is_training=True, global_batch_size=4, config={"seed": 1})
    # The calls of before that are not settings run as they did.
    inp = ImageNetInput(
        records[0], is_training=False, image_size=8, global_batch_size=4, label_offset=1,
        dtype="uint8",
    )
    images, labels = next(iter(inp.dataset()))
    assert images.dtype == tf.uint8 and inp.config == InputConfig()


def test_the_configuration_goes_to_json_and_back():
    import json

    config = InputConfig(crop_area_range=[0.5, 1], seed=4, data_service_address="grpc://d:1")
    assert config.crop_area_range == (0.5, 1.0)  # a list from JSON becomes the tuple
    text = json.dumps(config.to_dict())
    assert InputConfig.from_dict(json.loads(text)) == config
    assert InputConfig.from_dict({}) == InputConfig()
    assert json.loads(json.dumps(InputConfig(crop_area_range=None).to_dict()))["crop_area_range"] is None
    with pytest.raises(ValueError, match="Not InputConfig fields: bogus"):
        InputConfig.from_dict({"bogus": 1, "seed": 0})
    for bad, words in [
        (dict(crop_area_range=(0.5, 0.2)), "crop_area_range"),
        (dict(center_crop_fraction=0), "center_crop_fraction"),
        (dict(translate_fraction=0.5), "translate_fraction"),
        (dict(translate_fraction=-0.1), "translate_fraction"),
        (dict(resize_method="cubic"), "resize_method"),
        (dict(max_bad_fraction=2), "max_bad_fraction"),
        (dict(cycle_length=0), "cycle_length"),
        (dict(shuffle_buffer_size=0), "shuffle_buffer_size"),
    ]:
        with pytest.raises(ValueError, match=words):
            InputConfig(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.seed = 5
    assert config.replace(seed=5).seed == 5 and config.seed == 4


# --------------------------------------------------------------------------------------------------
# Evaluation path


@pytest.mark.parametrize("num_pipelines", [1, 2])
def test_eval_reads_every_example_once(records, num_pipelines):
    pattern, expected = records
    inp = make_input(pattern, is_training=False, global_batch_size=8 * num_pipelines)
    all_ids = []
    for index in range(num_pipelines):
        ids, labels, sizes = collect(inp.dataset(context(index, num_pipelines)))
        assert all(size == 8 for size in sizes[:-1]) and 0 < sizes[-1] <= 8
        assert labels == [expected[i] for i in ids]
        all_ids.extend(ids)
    assert sorted(all_ids) == sorted(expected)


def test_eval_is_deterministic(records):
    pattern, _ = records
    inp = make_input(pattern, is_training=False, global_batch_size=16, image_size=12)
    first = [batch for batch in inp.dataset()]
    second = [batch for batch in inp.dataset()]
    for (images_a, labels_a), (images_b, labels_b) in zip(first, second):
        np.testing.assert_array_equal(images_a.numpy(), images_b.numpy())
        np.testing.assert_array_equal(labels_a.numpy(), labels_b.numpy())


def test_the_last_batch_is_filled_by_the_exact_evaluation_only():
    with pytest.raises(TypeError, match=r"pad_last_batch is gone.*data\.exact_evaluation"):
        InputConfig(pad_last_batch=True)
    with pytest.raises(TypeError, match=r"pad_last_batch is gone.*data\.exact_evaluation"):
        InputConfig.from_dict({"pad_last_batch": False})
    with pytest.raises(TypeError, match=r"pad_last_batch is gone.*data\.exact_evaluation"):
        InputConfig().replace(pad_last_batch=True)


# --------------------------------------------------------------------------------------------------
# Training path


@pytest.mark.parametrize("num_pipelines", [1, 2])
def test_train_epochs_are_exact_with_cache(records, num_pipelines):
    pattern, expected = records
    # With cache, the shuffle comes before the repeat, so each epoch is one permutation of the
    # shard.
    inp = make_input(
        pattern, is_training=True, global_batch_size=6, cache=True, deterministic=True, seed=3
    )
    all_ids = []
    for index in range(num_pipelines):
        dataset = inp.dataset(context(index, num_pipelines))
        assert dataset.element_spec[0].shape == (6 // num_pipelines, IMAGE_SIZE, IMAGE_SIZE, 3)
        epoch = len(expected) // num_pipelines
        ids, labels, _ = collect(dataset, num_batches=2 * epoch // (6 // num_pipelines))
        assert sorted(ids[:epoch]) == sorted(ids[epoch:])  # the second epoch repeats the first
        assert ids[:epoch] != ids[epoch:]  # in a new order
        all_ids.extend(ids[:epoch])
    assert sorted(all_ids) == sorted(expected)


def test_train_without_cache_repeats_and_mixes_files(records):
    pattern, expected = records
    inp = make_input(pattern, is_training=True, global_batch_size=10, shuffle_buffer_size=16)
    ids, labels, sizes = collect(inp.dataset(), num_batches=24)  # 4 epochs
    assert set(sizes) == {10}
    assert set(ids) == set(expected)
    # The interleave mixes the 4 files (ids 0-14, 15-29, ...) within the first batches. (Which files
    # come first in the non-deterministic mode depends on timing; 20 examples span 3 files
    # reliably.)
    assert len({i // 15 for i in ids[:20]}) >= 3


def test_train_deterministic_mode_is_reproducible(records):
    pattern, _ = records

    def first_batches(seed):
        inp = make_input(
            pattern,
            is_training=True,
            global_batch_size=8,
            shuffle_buffer_size=32,
            deterministic=True,
            seed=seed,
        )
        return np.concatenate([images.numpy() for images, _ in inp.dataset().take(3)])

    np.testing.assert_array_equal(first_batches(7), first_batches(7))
    assert not np.array_equal(first_batches(7), first_batches(8))


@pytest.mark.parametrize("is_training", [True, False])
def test_uint8_pipeline_normalized_on_the_device_equals_the_float32_pipeline(records, is_training):
    from tpu_scale.layers import ImageNormalization

    def batches(dtype):
        inp = make_input(
            records[0],
            is_training=is_training,
            global_batch_size=6,
            dtype=dtype,
            deterministic=True,
            seed=5,
            shuffle_buffer_size=8,
        )
        return list(inp.dataset().take(3))

    normalize = ImageNormalization()
    for (raw, raw_labels), (floats, labels) in zip(batches("uint8"), batches("float32")):
        assert raw.dtype == tf.uint8 and raw.shape == floats.shape
        np.testing.assert_array_equal(raw_labels.numpy(), labels.numpy())
        # Within the rounding of a pixel to a grey level: 0.5 / the smallest stddev (57.4).
        np.testing.assert_allclose(normalize(raw).numpy(), floats.numpy(), atol=0.5 / 57.3, rtol=0)


def test_uint8_is_a_quarter_of_float32s_bytes(records):
    sizes = {}
    for dtype in ("uint8", "float32"):
        images, _ = next(
            iter(
                make_input(
                    records[0], is_training=False, global_batch_size=4, dtype=dtype
                ).dataset()
            )
        )
        sizes[dtype] = images.numpy().nbytes
    assert sizes["float32"] == 4 * sizes["uint8"]
    with pytest.raises(ValueError, match="uint8 \\(raw pixels\\)"):
        make_input(records[0], is_training=False, global_batch_size=4, dtype="int32")


def test_train_bfloat16_and_label_dtype(records):
    inp = make_input(
        records[0], is_training=True, global_batch_size=4, dtype="bfloat16", shuffle_buffer_size=8
    )
    images, labels = next(iter(inp.dataset()))
    assert images.dtype == tf.bfloat16 and labels.dtype == tf.int32


def test_options_are_set(records):
    inp = make_input(records[0], is_training=True, global_batch_size=4, threadpool_size=3)
    options = inp.dataset().options()
    assert options.threading.private_threadpool_size == 3
    assert options.autotune.enabled is False and options.deterministic is False


def test_the_decode_runs_on_every_thread_of_the_pool(records):
    # Autotuning is off, so an AUTOTUNE parallelism would stay at its start value (at most 16): a
    # host with more cores than that must still decode on all of them (one call of the decode
    # stage per thread, see `input_pipeline.DecodeStage`).
    from tensorflow.core.framework import graph_pb2

    inp = make_input(records[0], is_training=True, global_batch_size=4, threadpool_size=37)
    graph = graph_pb2.GraphDef.FromString(inp.dataset()._as_serialized_graph().numpy())
    nodes = {node.name: node for node in graph.node}
    # The stage's calls are the pipeline's one parallel map; its last input is the parallelism.
    (parallelism,) = [
        nodes[stage.input[-1]].attr["value"].tensor.int64_val
        for stage in nodes.values()
        if stage.op == "ParallelMapDatasetV2"
    ]
    assert list(parallelism) == [37]


def test_record_level_sharding_with_fewer_files_than_pipelines(tmp_path):
    pattern, expected = write_coded_records(str(tmp_path), num_files=1, per_file=20)
    inp = make_input(pattern, is_training=False, global_batch_size=8)
    all_ids = []
    for index in range(2):
        with pytest.warns(UserWarning, match="keeps 1 record in 2"):
            dataset = inp.dataset(context(index, 2))
        ids, _, _ = collect(dataset)
        assert len(ids) == 10
        all_ids.extend(ids)
    assert sorted(all_ids) == sorted(expected)


def test_a_small_evaluation_is_cached_and_a_large_one_is_not(records, cpu_devices):
    # The rule: one pass's decoded images on an input pipeline, against CACHE_LIMIT_BYTES.
    from tpu_scale.data import evaluation

    strategy = tpu_scale.distribute.strategy.MirroredStrategy(cpu_devices[:2])
    small = make_input(records[0], is_training=False, global_batch_size=8)
    # 60 examples: 8 steps of 8 images of 8x8x3 float32 = 49,152 bytes.
    assert evaluation.pass_bytes(small, 8, 8) == 8 * 8 * 8 * 8 * 3 * 4
    assert evaluation.exact_evaluation(small, strategy, 60).cached
    assert not evaluation.exact_evaluation(small, strategy, 60, cache=False).cached
    # ImageNet's validation set at 224 px in float32: 30 GB, read from the records every pass.
    large = make_input(records[0], is_training=False, global_batch_size=8, image_size=224)
    assert evaluation.pass_bytes(large, 6250, 8) > 50 * evaluation.CACHE_LIMIT_BYTES
    assert not evaluation.exact_evaluation(large, strategy, 50_000).cached
    assert evaluation.exact_evaluation(large, strategy, 50_000, cache=True).cached
    # In uint8 a quarter of the bytes: the limit holds 4x the images.
    raw = make_input(records[0], is_training=False, global_batch_size=8, dtype="uint8")
    assert evaluation.pass_bytes(raw, 8, 8) * 4 == evaluation.pass_bytes(small, 8, 8)


@pytest.mark.parametrize("cache", [True, False])
def test_a_cached_evaluation_reads_its_records_once(tmp_path, cpu_devices, cache):
    # Every pass counts every good example once, from new iterators (as Keras's evaluate makes
    # them) and from one; the cached one reads the records in its first complete pass only, and
    # names and counts its bad record once.
    from tpu_scale.data import evaluation

    make_bad = RECORD_FAULTS["frame height 0"][0]
    pattern, good = write_records_with(str(tmp_path), {4: make_bad}, num_files=2, per_file=13)
    strategy = tpu_scale.distribute.strategy.MirroredStrategy(cpu_devices[:2])
    inp = make_input(pattern, is_training=False, global_batch_size=4, max_bad_fraction=1.0)
    exact = evaluation.exact_evaluation(inp, strategy, 26, cache=cache)
    assert exact.cached == cache and exact.steps == 7

    def one_pass(iterator):
        ids = []
        for _ in range(exact.steps):
            images, labels, weights = next(iterator)
            for replica_images, replica_labels, replica_weights in zip(
                strategy.experimental_local_results(images),
                strategy.experimental_local_results(labels),
                strategy.experimental_local_results(weights),
            ):
                real = replica_weights.numpy() > 0  # the fill-up past the data weighs nothing
                codes, batch_ids = decode_codes(tf.boolean_mask(replica_images, real))
                np.testing.assert_array_equal(codes, replica_labels.numpy()[real])
                ids.extend(batch_ids.tolist())
        return sorted(ids)

    next(iter(exact.dataset))  # a batch read and the iterator left, as Keras's peek does
    iterator = iter(exact.dataset)
    assert one_pass(iterator) == sorted(good)
    read_after_first_pass = inp.records_read
    assert one_pass(iterator) == sorted(good)  # the next pass from the same iterator
    for _ in range(2):
        assert one_pass(iter(exact.dataset)) == sorted(good)  # and from new ones
    assert inp.distinct_skipped_records == 1
    if cache:
        assert inp.records_read == read_after_first_pass
    else:
        assert inp.records_read >= 3 * 26 and inp.skipped_records >= 3


@pytest.mark.parametrize("num_replicas", [2, 4])
def test_distribute_datasets_from_function(records, cpu_devices, num_replicas):
    strategy = tpu_scale.distribute.strategy.MirroredStrategy(cpu_devices[:num_replicas])
    inp = make_input(records[0], is_training=True, global_batch_size=8)
    distributed = strategy.distribute_datasets_from_function(inp.dataset)
    images, labels = next(iter(distributed))
    local_images = strategy.experimental_local_results(images)
    assert len(local_images) == num_replicas
    assert all(x.shape == (8 // num_replicas, IMAGE_SIZE, IMAGE_SIZE, 3) for x in local_images)
    for replica_images, replica_labels in zip(
        local_images, strategy.experimental_local_results(labels)
    ):
        np.testing.assert_array_equal(decode_codes(replica_images)[0], replica_labels.numpy())


def test_keras_fit_and_evaluate_on_distributed_datasets(records, cpu_devices):
    import keras

    pattern, expected = records
    strategy = tpu_scale.distribute.strategy.MirroredStrategy(cpu_devices[:2])
    train = make_input(pattern, is_training=True, global_batch_size=8, shuffle_buffer_size=16)
    validation = make_input(pattern, is_training=False, global_batch_size=16)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((IMAGE_SIZE, IMAGE_SIZE, 3)),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(NUM_CLASSES),
            ]
        )
        model.compile(
            "sgd",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"],
        )
    history = model.fit(
        strategy.distribute_datasets_from_function(train.dataset),
        steps_per_epoch=3,
        epochs=1,
        verbose=0,
    )
    assert np.isfinite(history.history["loss"][0])
    # The filled batches carry weights, so the filling (4 of 64 slots) does not count.
    evaluation = data.exact_evaluation(validation, strategy, len(expected))
    results = model.evaluate(
        evaluation.dataset, steps=evaluation.steps, verbose=0, return_dict=True
    )
    correct = [
        np.argmax(model(images, training=False), axis=1) == labels.numpy()
        for images, labels in validation.dataset()
    ]
    correct = np.concatenate(correct)
    assert len(correct) == len(expected)
    assert results["accuracy"] == pytest.approx(correct.mean(), abs=1e-6)


def test_synthetic_source_shapes(cpu_devices):
    inp = SyntheticImageNetInput(
        global_batch_size=8, image_size=16, num_classes=10, dtype=tf.bfloat16
    )
    images, labels = next(iter(inp.dataset(context(1, 2))))
    assert images.shape == (4, 16, 16, 3) and images.dtype == tf.bfloat16
    assert labels.dtype == tf.int32 and 0 <= labels.numpy().min() and labels.numpy().max() < 10


def test_the_synthetic_input_left_the_package_for_the_tests():
    with pytest.raises(AttributeError, match=r"tests/synthetic_input\.py.*make_synthetic_imagenet"):
        data.SyntheticImageNetInput
    assert "SyntheticImageNetInput" not in data.__all__
    for removed in ("records_inputs", "RecordInputs"):
        with pytest.raises(AttributeError, match=r"data\.inputs\("):
            getattr(data, removed)


# --------------------------------------------------------------------------------------------------
# Image operations


def test_random_crop_window_stays_in_inception_ranges():
    height, width = 375, 500
    seeds = tf.stack(
        [tf.range(4000, dtype=tf.int64), tf.fill([4000], tf.constant(11, tf.int64))], axis=1
    )

    def sample(seed):
        return image_ops.sample_crop_window(tf.constant(height), tf.constant(width), seed)

    windows = tf.function(lambda: tf.map_fn(sample, seeds, fn_output_signature=tf.int32))().numpy()
    offset_y, offset_x, crop_h, crop_w = windows.T
    assert (offset_y >= 0).all() and (offset_x >= 0).all()
    assert (offset_y + crop_h <= height).all() and (offset_x + crop_w <= width).all()
    area = crop_h * crop_w / (height * width)
    aspect = crop_w / crop_h
    # Rounding each side to whole pixels moves area and aspect by at most about one pixel's worth.
    slack = 1.0 / crop_h + 1.0 / crop_w
    assert (area >= 0.08 * (1 - slack)).all() and (area <= 1.0).all()
    assert (aspect >= 0.75 * (1 - slack)).all() and (aspect <= (4 / 3) * (1 + slack)).all()
    # The distribution matches the definition, simulated here independently with numpy: area
    # fraction uniform in [0.08, 1], log aspect uniform, first of 10 boxes that fits.
    rng = np.random.default_rng(0)
    areas = rng.uniform(0.08, 1.0, (100_000, 10)) * height * width
    ratios = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3), (100_000, 10)))
    widths, heights = np.rint(np.sqrt(areas * ratios)), np.rint(np.sqrt(areas / ratios))
    fits = (widths <= width) & (heights <= height)
    first = fits.argmax(axis=1)
    rows = np.arange(100_000)
    expected_area = (widths[rows, first] * heights[rows, first]).mean() / (height * width)
    expected_aspect = (widths[rows, first] / heights[rows, first]).mean()
    assert abs(area.mean() - expected_area) < 0.015
    assert abs(aspect.mean() - expected_aspect) < 0.015
    assert area.min() < 0.1 and area.max() > 0.9
    assert aspect.min() < 0.8 and aspect.max() > 1.25
    # Positions spread over the image rather than sticking to a corner.
    assert len(set(offset_x.tolist())) > 100


def test_random_crop_falls_back_to_center_crop_when_nothing_fits():
    # A 10x1000 strip: every box with area >= 8% and aspect <= 4/3 is taller than 10 pixels.
    window = image_ops.sample_crop_window(tf.constant(10), tf.constant(1000), tf.constant([1, 2]))
    np.testing.assert_array_equal(window, image_ops.center_crop_window(10, 1000))


def test_center_crop_window_matches_reference_padding():
    # 224 / (224 + 32) of the 375-pixel short side.
    np.testing.assert_array_equal(image_ops.center_crop_window(375, 500), [24, 86, 328, 328])


def test_center_crop_keeps_the_same_fraction_at_small_sizes():
    # 7/8 of the short side whatever the output size; 32 / (32 + 32) would keep only half of a
    # small image's short side at 32 pixels.
    np.testing.assert_array_equal(image_ops.center_crop_window(64, 64), [4, 4, 56, 56])


def test_fused_decode_matches_full_decode_then_crop():
    rng = np.random.default_rng(0)
    image = tf.image.resize(rng.uniform(0, 255, (1, 12, 16, 3)), (60, 80), "bicubic")[0]
    # Without chroma subsampling the window decodes exactly like the same pixels of a full decode.
    jpeg = tf.io.encode_jpeg(
        tf.cast(tf.clip_by_value(image, 0, 255), tf.uint8), quality=95, chroma_downsampling=False
    )
    flips = set()
    for seed in [tf.constant([5, i], tf.int64) for i in range(8)]:
        flips.add(_check_fused_decode(jpeg, seed))
    assert flips == {True, False}  # both branches of the flip were compared


def _check_fused_decode(jpeg, seed):
    fused = image_ops.decode_and_random_crop(jpeg, 32, seed)
    # The same seed gives the same window as `sample_crop_window`; the draw after the window's
    # decides the flip.
    y, x, h, w = image_ops.sample_crop_window(60, 80, seed).numpy()
    full = tf.io.decode_jpeg(jpeg, channels=3)[y : y + h, x : x + w]
    reference = tf.image.resize(full, (32, 32))
    flip = bool(tf.random.stateless_uniform([2 * image_ops.MAX_ATTEMPTS + 3], seed)[-1] < 0.5)
    if flip:
        reference = reference[:, ::-1]
    np.testing.assert_allclose(fused.numpy(), reference.numpy(), atol=2.0)
    return flip


def test_translation_moves_the_image_by_whole_pixels_within_its_range():
    image = np.zeros((16, 16, 1), np.float32)
    image[8, 5] = 1.0
    shifts = set()
    for i in range(200):
        draws = tf.random.stateless_uniform([2], tf.constant([7, i], tf.int64))
        moved = image_ops.random_translate(tf.constant(image), 0.125, draws).numpy()
        assert moved.shape == image.shape
        (y,), (x,), _ = np.nonzero(moved)  # the one bright pixel, moved, nothing resized
        shifts.add((int(y) - 8, int(x) - 5))
    # Up to round(0.125 * 16) = 2 pixels each way, every offset drawn.
    assert shifts == {(dy, dx) for dy in range(-2, 3) for dx in range(-2, 3)}
    same = image_ops.random_translate(tf.constant(image), 0.01, tf.constant([0.0, 0.9]))
    np.testing.assert_array_equal(same.numpy(), image)  # rounds to no pixel: unchanged


def test_translated_decode_is_the_whole_image_shifted_with_zeros_coming_in():
    rng = np.random.default_rng(1)
    pixels = rng.integers(1, 255, (32, 32, 3), dtype=np.uint8)  # no zero pixel of its own
    png = tf.io.encode_png(pixels)
    seen = set()
    for i in range(20):
        seed = tf.constant([3, i], tf.int64)
        whole = image_ops.decode_and_random_crop(png, 32, seed, area_range=None, flip=False)
        moved = image_ops.decode_and_random_crop(
            png, 32, seed, area_range=None, flip=False, translate_fraction=0.125
        ).numpy()
        np.testing.assert_array_equal(whole.numpy(), pixels)
        # The draws after the flip's give the offsets: pad 4, the square at (dy, dx) of the padded.
        draws = tf.random.stateless_uniform([2 * image_ops.MAX_ATTEMPTS + 5], seed)[-2:]
        dy, dx = np.minimum((draws.numpy() * 9).astype(int), 8)
        padded = np.pad(pixels, [(4, 4), (4, 4), (0, 0)])
        np.testing.assert_array_equal(moved, padded[dy : dy + 32, dx : dx + 32])
        seen.add((dy, dx))
    assert len(seen) > 5


def test_the_pipeline_translates_training_images_only(records):
    def zero_borders(**settings):
        inp = make_input(
            records[0], global_batch_size=15, crop_area_range=None, random_flip=False,
            dtype=tf.uint8, **settings,
        )
        images, _ = next(iter(inp.dataset()))
        images = images.numpy()
        images = images[images.max(axis=(1, 2, 3)) > 0]  # not the one black record
        rows = np.all(images == 0, axis=(2, 3)).sum(axis=1)
        columns = np.all(images == 0, axis=(1, 3)).sum(axis=1)
        return rows, columns

    rows, columns = zero_borders(is_training=True, translate_fraction=0.25, seed=0)
    assert rows.max() <= 2 and columns.max() <= 2  # round(0.25 * 8) pixels at most
    assert (rows + columns).max() > 0
    for flat in (
        zero_borders(is_training=True, seed=0),
        zero_borders(is_training=False, translate_fraction=0.25, center_crop_fraction=1.0),
    ):
        assert flat[0].max() == flat[1].max() == 0  # whole images


# --------------------------------------------------------------------------------------------------
# Bad input


def test_pattern_matching_nothing_names_the_pattern(tmp_path):
    pattern = str(tmp_path / "missing-*")
    inp = make_input(pattern, is_training=True, global_batch_size=4)
    with pytest.raises(ValueError, match="missing-"):
        inp.dataset()


def truncated(jpeg):
    return jpeg[: len(jpeg) // 2]


def as_png(jpeg):
    return tf.io.encode_png(tf.io.decode_jpeg(jpeg)).numpy()


def bogus_frame_header(jpeg):
    # Complete file (start and end markers present) whose frame header is nonsense: only libjpeg
    # notices.
    return jpeg[:2] + b"\xff\xc0\x00\x11\x08\xff\xff\xff\xff" + jpeg[2:]


def frame_height_zero(jpeg):
    # A complete JPEG whose start-of-frame segment says height 0 (a damaged download): libjpeg
    # rejects it ("Empty JPEG image (DNL not supported)") in ExtractJpegShape.
    at = jpeg.index(b"\xff\xc0") + 5
    return jpeg[:at] + b"\x00\x00" + jpeg[at + 2 :]


def bad_huffman_table(jpeg):
    # A complete JPEG whose Huffman table segment is broken: libjpeg rejects it.
    at = jpeg.index(b"\xff\xc4") + 4
    return jpeg[:at] + b"\xff" + jpeg[at + 1 :]


BREAKAGES = {
    "truncated": truncated,
    "empty": lambda jpeg: b"",
    "garbage": lambda jpeg: b"not an image at all" * 5,
    "frame height 0": frame_height_zero,
    "bad Huffman table": bad_huffman_table,
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_strict_fails_naming_the_record(tmp_path, breakage):
    pattern, _ = write_coded_records(str(tmp_path), 2, 6, bad={8: BREAKAGES[breakage]})
    inp = make_input(pattern, is_training=False, global_batch_size=4, strict=True)
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"strict=True: record 2 of \S*train-00001-of-00002 (is not a complete|holds an im)",
    ):
        list(inp.dataset())


def test_wrong_feature_keys_list_the_keys_found(tmp_path):
    path = str(tmp_path / "records")
    example = tf.train.Example(
        features=tf.train.Features(
            feature={
                "jpeg": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"x"])),
                "class": tf.train.Feature(int64_list=tf.train.Int64List(value=[1])),
            }
        )
    )
    with tf.io.TFRecordWriter(path) as writer:
        writer.write(example.SerializeToString())
    inp = make_input(path, is_training=False, global_batch_size=4)
    with pytest.raises(
        ValueError, match=r"image/encoded.*Keys found: 'class' \(int64_list\), 'jpeg'"
    ):
        inp.dataset()


def test_negative_label_names_the_file_and_the_fix(tmp_path):
    # Label 0 in a file read with label_offset=1.
    pattern, _ = write_coded_records(str(tmp_path), 1, 4, label_base=0)
    inp = make_input(pattern, is_training=False, global_batch_size=4, strict=True)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"(?s)train-00000-of-00001.*label_offset=0"
    ):
        list(inp.dataset())


def coded_example(example_id, label_base=1, jpeg=None, label=None):
    label = example_id % NUM_CLASSES + label_base if label is None else label
    jpeg = coded_jpeg(example_id, example_id % NUM_CLASSES, 20, 24) if jpeg is None else jpeg
    return make_example(jpeg, label, height=20, width=24).SerializeToString()


def without_label(example_id):
    example = tf.train.Example.FromString(coded_example(example_id))
    del example.features.feature["image/class/label"]
    return example.SerializeToString()


# Bad record kinds: how to make one from an example id, the error's words, the skip reason.
RECORD_FAULTS = {
    "not an Example": (
        lambda i: b"\xde\xad\xbe\xef this is no protobuf " * 3,
        "not a serialized tf.train.Example",
        "not a tf.train.Example",
    ),
    "missing label": (without_label, "lacks the image or the label feature", "missing feature"),
    "label too large": (
        lambda i: coded_example(i, label=NUM_CLASSES + 1),
        "label >= num_classes=5 after subtracting label_offset=1",
        "label >= num_classes",
    ),
    "undecodable JPEG": (
        lambda i: coded_example(i, jpeg=truncated(coded_jpeg(i, 0, 20, 24))),
        "not a complete JPEG",
        "not a complete image",
    ),
    "frame height 0": (
        lambda i: coded_example(i, jpeg=frame_height_zero(coded_jpeg(i, i % NUM_CLASSES, 20, 24))),
        "holds an image the decoder rejects",
        "undecodable image",
    ),
    "image of another type": (
        lambda i: tf.train.Example(
            features=tf.train.Features(
                feature={
                    "image/encoded": tf.train.Feature(int64_list=tf.train.Int64List(value=[7])),
                    "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[1])),
                }
            )
        ).SerializeToString(),
        "with another type than bytes and int64",
        "feature of the wrong type",
    ),
}


def write_records_with(directory, bad, *, num_files=2, per_file=6, cut_last_file_bytes=0):
    """Coded records; `bad` maps example ids to serialized replacements. Returns (pattern, good
    ids)."""
    os.makedirs(directory, exist_ok=True)
    good = set()
    for file_index in range(num_files):
        path = os.path.join(directory, f"train-{file_index:05d}-of-{num_files:05d}")
        with tf.io.TFRecordWriter(path) as writer:
            for example_id in range(file_index * per_file, (file_index + 1) * per_file):
                if example_id in bad:
                    writer.write(bad[example_id](example_id))
                else:
                    writer.write(coded_example(example_id))
                    good.add(example_id)
    if cut_last_file_bytes:
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:-cut_last_file_bytes])
        good.discard(num_files * per_file - 1)
    return os.path.join(directory, "train-*"), good


def write_record_counts(directory, counts):
    """A label map for `write_records_with`'s files that gives each file's record count, as
    `write_tfrecords` writes one."""
    from tpu_scale.data.schema import write_label_map

    names = [f"class_{i}" for i in range(NUM_CLASSES)]
    files = {f"train-{i:05d}-of-{len(counts):05d}": n for i, n in enumerate(counts)}
    write_label_map(directory, names, 1, record_counts=files)


def test_an_iterator_left_behind_makes_no_false_reports(tmp_path, caplog):
    # Keras's fit draws one batch from an iterator to build the model and drops it; records that
    # iterator listed must not be taken for the decoder's rejects by the next one.
    make_bad = RECORD_FAULTS["frame height 0"][0]
    pattern, _ = write_records_with(str(tmp_path), {5: make_bad}, num_files=2, per_file=20)
    # Files of known counts: a parse batch then leaves gaps in the numbers where the files end,
    # at other places in each iterator's shuffled stream.
    write_record_counts(str(tmp_path), [20, 20])
    inp = make_input(
        pattern,
        is_training=True,
        global_batch_size=4,
        num_classes=NUM_CLASSES,
        seed=3,
        max_bad_fraction=0.5,
    )
    dataset = inp.dataset()
    behind = iter(dataset)
    next(behind)
    ahead = iter(dataset)
    for _ in range(RECORDS_PER_CALL):
        next(ahead)
    # `behind` lists records that `ahead` has long taken out (parsing ahead of its decode), then
    # is dropped.
    for _ in range(RECORDS_PER_CALL // 4):
        next(behind)
    del behind
    for _ in range(RECORDS_PER_CALL):
        next(ahead)
    named = {r.getMessage().split(":")[0] for r in caplog.records if "Skipped" in r.getMessage()}
    assert named == {f"Skipped record 5 of {tmp_path}/train-00000-of-00002"}
    assert set(inp.skipped_by_reason) == {"undecodable image"}


@pytest.mark.parametrize(
    "kind", sorted(RECORD_FAULTS) + ["truncated file", "truncated file of known count"]
)
def test_bad_record_fails_naming_file_and_record(tmp_path, kind):
    if kind.startswith("truncated file"):
        # The last record of the second file loses its end: it is record 5 of that file.
        pattern, _ = write_records_with(str(tmp_path), {}, cut_last_file_bytes=30)
        words, index = "truncated or corrupted", 5
        if kind.endswith("known count"):
            write_record_counts(str(tmp_path), [6, 6])
    else:
        make_bad, words, _ = RECORD_FAULTS[kind]
        pattern, _ = write_records_with(str(tmp_path), {8: make_bad})  # record 2 of the second file
        index = 2
    inp = make_input(
        pattern, is_training=False, global_batch_size=4, num_classes=NUM_CLASSES, strict=True
    )
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=rf"(?s)strict=True: record {index} of \S*train-00001-of-00002 .*{words}",
    ):
        list(inp.dataset())


@pytest.mark.parametrize("kind", sorted(RECORD_FAULTS) + ["truncated file"])
def test_bad_record_is_skipped_named_and_counted(tmp_path, kind, caplog):
    if kind == "truncated file":
        pattern, good = write_records_with(str(tmp_path), {}, cut_last_file_bytes=30)
        reason = "truncated TFRecord file"
    else:
        make_bad, _, reason = RECORD_FAULTS[kind]
        # Mid-file, and the very last record (the count must not lose trailing skips).
        pattern, good = write_records_with(str(tmp_path), {3: make_bad, 8: make_bad, 11: make_bad})
    # Above the default threshold (3 bad records of 12), but below the floor of 10 bad records.
    inp = make_input(pattern, is_training=False, global_batch_size=4, num_classes=NUM_CLASSES)
    ids, labels, _ = collect(inp.dataset())
    assert sorted(ids) == sorted(good)
    assert labels == [i % NUM_CLASSES for i in ids]
    expected = 12 - len(good)
    assert inp.skipped_records == expected and inp.skipped_by_reason == {reason: expected}
    assert inp.records_read == 12
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipped")]
    assert len(named) == expected
    for bad_id in sorted(set(range(12)) - good):
        file_index, index = divmod(bad_id, 6)
        assert any(f"record {index} of " in m and f"train-{file_index:05d}-of" in m for m in named)


@pytest.mark.parametrize("is_training", [False, True])
def test_files_of_known_count_are_read_without_counting_bytes(tmp_path, monkeypatch, is_training):
    # Files whose record counts the label map gives: every example once, with its own label, and
    # no file read by the byte-counting reader.
    from tpu_scale.data.sources import TFRecordSource

    def byte_counting_reader(*args):
        raise AssertionError("the byte-counting reader ran")

    monkeypatch.setattr(TFRecordSource, "_read_file", byte_counting_reader)
    pattern, good = write_records_with(str(tmp_path), {}, num_files=3, per_file=7)
    write_record_counts(str(tmp_path), [7, 7, 7])
    inp = make_input(
        pattern,
        is_training=is_training,
        global_batch_size=3,
        shuffle_buffer_size=4,
        num_classes=NUM_CLASSES,
    )
    ids, labels, _ = collect(inp.dataset(), num_batches=21 if is_training else None)
    assert labels == [i % NUM_CLASSES for i in ids]
    if is_training:  # three passes; the shuffle buffer of 4 holds back at most 4 of the third
        assert set(ids) == good and len(ids) == 63
    else:
        assert sorted(ids) == sorted(good)


@pytest.mark.parametrize("cut", [0, 30])
def test_files_of_known_count_shared_record_by_record(tmp_path, cut):
    # One file for three input pipelines: each keeps every third record of the same stream, end
    # marker included. Together they read every example once, and a cut file is still named.
    pattern, good = write_records_with(
        str(tmp_path), {}, num_files=1, per_file=11, cut_last_file_bytes=cut
    )
    write_record_counts(str(tmp_path), [11])
    with pytest.warns(UserWarning, match="every pipeline reads every file"):
        inp = make_input(
            pattern, is_training=False, global_batch_size=6, num_classes=NUM_CLASSES, strict=True
        )
        datasets = [inp.dataset(context(index, 3)) for index in range(3)]
    if cut:
        where = r"(?s)record 10 of .*labels\.json"
        with pytest.raises(tf.errors.InvalidArgumentError, match=where):
            for dataset in datasets:
                collect(dataset)
        return
    ids = []
    for dataset in datasets:
        found, labels, _ = collect(dataset)
        assert labels == [i % NUM_CLASSES for i in found]
        ids.extend(found)
    assert sorted(ids) == sorted(good)


@pytest.mark.parametrize("written,counted", [(6, 7), (7, 6)])
def test_a_file_whose_count_disagrees_with_the_label_map_is_named(tmp_path, written, counted):
    # A file with fewer or more records than its count in labels.json (a file replaced after the
    # conversion) fails at its end, naming it and where its records ran out.
    pattern, _ = write_records_with(str(tmp_path), {}, num_files=2, per_file=written)
    write_record_counts(str(tmp_path), [written, counted])
    inp = make_input(
        pattern, is_training=False, global_batch_size=4, num_classes=NUM_CLASSES, strict=True
    )
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=rf"(?s)record {written} of \S*train-00001-of-00002 .*labels\.json",
    ):
        list(inp.dataset())


def test_first_record_not_an_example_fails_when_the_pipeline_is_built(tmp_path):
    pattern, good = write_records_with(str(tmp_path), {0: RECORD_FAULTS["not an Example"][0]})
    with pytest.raises(
        ValueError, match=r"Record 0 of \S*train-00000-of-00002.*not a tf.train.Example"
    ):
        make_input(pattern, is_training=False, global_batch_size=4, strict=True).dataset()
    inp = make_input(pattern, is_training=False, global_batch_size=4)
    assert sorted(collect(inp.dataset())[0]) == sorted(good) and inp.skipped_records == 1


def every_fault_kind(directory):
    """Two files of 20 records: one record of every fault kind, other image formats, good JPEGs.

    Returns the pattern, the good ids, and the bad ones as `{(file index, record index): reason}`.
    """

    def image_as(fmt, mode="RGB", **options):
        def encode(i):
            from io import BytesIO

            from PIL import Image

            pixels = tf.io.decode_jpeg(coded_jpeg(i, i % NUM_CLASSES, 20, 24)).numpy()
            out = BytesIO()
            Image.fromarray(pixels).convert(mode).save(out, fmt, **options)
            return coded_example(i, jpeg=out.getvalue())

        return encode

    faults = {name: make for name, (make, _, _) in RECORD_FAULTS.items()}
    faults["negative label"] = lambda i: coded_example(i, label=0)
    faults["frame height 0"] = RECORD_FAULTS["frame height 0"][0]
    faults["bad Huffman table"] = lambda i: coded_example(
        i, jpeg=bad_huffman_table(coded_jpeg(i, 0, 20, 24))
    )
    faults["empty image"] = lambda i: coded_example(i, jpeg=b"")
    faults["text"] = lambda i: coded_example(i, jpeg=b"no image here" * 9)
    reasons = {name: reason for name, (_, _, reason) in RECORD_FAULTS.items()} | {
        "negative label": "negative label",
        "bad Huffman table": "undecodable image",
        "empty image": "not a complete image",
        "text": "not a complete image",
    }
    kinds = sorted(faults)
    bad = {1 + 3 * n: faults[kind] for n, kind in enumerate(kinds)}
    good_formats = {
        2: image_as("PNG"),
        5: image_as("GIF"),
        8: image_as("BMP"),
        11: image_as("JPEG", "CMYK", quality=95),
        14: image_as("JPEG", quality=95, progressive=True),
        17: image_as("WEBP", lossless=True),
    }
    pattern, good = write_records_with(
        directory, {**bad, **good_formats}, num_files=2, per_file=20, cut_last_file_bytes=30
    )
    good |= set(good_formats)
    named = {divmod(i, 20): reasons[kind] for i, kind in zip(sorted(bad), kinds)}
    named[(1, 19)] = "truncated TFRecord file"
    return pattern, good, named


@pytest.mark.parametrize("is_training", [False, True])
def test_every_fault_kind_is_skipped_named_and_counted(tmp_path, caplog, is_training):
    # Evaluation and training finish; every good record (other formats included) comes out once
    # with its label; the log names each bad record once, with its file and index.
    pattern, good, bad = every_fault_kind(str(tmp_path))
    inp = make_input(
        pattern,
        is_training=is_training,
        global_batch_size=1,
        num_classes=NUM_CLASSES,
        max_bad_fraction=1.0,
        deterministic=True,
        cache=is_training,
    )
    ids, labels, _ = collect(inp.dataset(), num_batches=len(good) + 1 if is_training else None)
    assert labels == [i % NUM_CLASSES for i in ids]
    assert sorted(ids[: len(good)]) == sorted(good)
    named = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipped")]
    assert len(named) == len(bad)  # once each, even when read again
    for (file_index, index), reason in bad.items():
        assert sum(f"record {index} of " in m and f"train-{file_index:05d}-of" in m for m in named)
    expected = {}
    for reason in bad.values():
        expected[reason] = expected.get(reason, 0) + 1
    if is_training:  # the second pass has begun: some records are counted twice
        assert set(inp.skipped_by_reason) == set(expected)
        assert inp.records_read >= 40
    else:
        assert inp.skipped_by_reason == expected and inp.records_read == 40
        assert inp.skipped_records == len(bad)
        # The epoch-end callback says it, for an honest denominator of an evaluation.
        from tpu_scale.data import SkippedRecordsLogger

        caplog.clear()
        SkippedRecordsLogger(inp).on_epoch_end(0)
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith(f"epoch 1: validation skipped {len(bad)} of 40 records read (")
        assert f"undecodable image: {expected['undecodable image']}" in line


@pytest.mark.parametrize("num_bad", [9, 11])
def test_too_many_bad_records_stop_the_run_naming_them(tmp_path, num_bad):
    # 20 records: 9 bad ones pass (fewer than the floor of 10), 11 stop the run, naming the first.
    make_bad = RECORD_FAULTS["frame height 0"][0]
    pattern, good = write_records_with(
        str(tmp_path), dict.fromkeys(range(0, 2 * num_bad, 2), make_bad), num_files=1, per_file=20
    )
    inp = make_input(pattern, is_training=False, global_batch_size=4)
    if num_bad < 10:
        assert sorted(collect(inp.dataset())[0]) == sorted(good)
        return
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"1\d bad records among the \d+ records read, more than max_bad_fraction=0.001.*"
        r"The first: record 0 of \S*train-00000-of-00001 \(undecodable image\), record 2 of",
    ):
        collect(inp.dataset())


def test_other_formats_decode_to_pillows_pixels(tmp_path):
    # CMYK, progressive and greyscale JPEGs on the fused path, PNG and BMP through decode_image:
    # the whole image (center_crop_fraction=1 on a square image, no resize) equals Pillow's decode.
    from io import BytesIO

    from PIL import Image

    rng = np.random.default_rng(0)
    smooth = tf.image.resize(rng.uniform(0, 255, (4, 4, 3)), [32, 32]).numpy().astype(np.uint8)
    formats = {
        "cmyk": ("JPEG", "CMYK", {"quality": 95}),
        "progressive": ("JPEG", "RGB", {"quality": 95, "progressive": True}),
        "grey": ("JPEG", "L", {"quality": 95}),
        "png": ("PNG", "RGB", {}),
        "bmp": ("BMP", "RGB", {}),
    }
    path = str(tmp_path / "train-00000-of-00001")
    expected = []
    with tf.io.TFRecordWriter(path) as writer:
        for fmt, mode, options in formats.values():
            out = BytesIO()
            Image.fromarray(smooth).convert(mode).save(out, fmt, **options)
            expected.append(np.asarray(Image.open(BytesIO(out.getvalue())).convert("RGB")))
            writer.write(make_example(out.getvalue(), 1, height=32, width=32).SerializeToString())
    inp = make_input(
        path,
        is_training=False,
        global_batch_size=len(formats),
        image_size=32,
        dtype="uint8",
        center_crop_fraction=1.0,
        strict=True,
    )
    ((images, _),) = list(inp.dataset())
    for name, image, reference in zip(formats, images.numpy(), expected):
        difference = np.abs(image.astype(int) - reference.astype(int))
        # Lossless formats match exactly; JPEG decoders differ by their IDCT and upsampling, and a
        # CMYK JPEG also by the formula that turns CMYK into RGB.
        largest, mean = {"png": (0, 0), "bmp": (0, 0), "cmyk": (12, 2.5)}.get(name, (10, 2))
        assert difference.max() <= largest and difference.mean() <= mean, (name, difference.mean())


def test_label_map_sets_offset_and_num_classes(tmp_path):
    from tpu_scale.data.schema import write_label_map

    pattern, expected = write_coded_records(str(tmp_path), 1, 10, label_base=0)
    names = [f"class_{i}" for i in range(NUM_CLASSES)]
    write_label_map(str(tmp_path), names, 0, {"train": 10})
    inp = make_input(pattern, is_training=False, global_batch_size=10)
    assert (inp.label_offset, inp.num_classes) == (0, NUM_CLASSES)
    assert inp.label_map.counts == {"train": 10}
    ids, labels, _ = collect(inp.dataset())
    assert labels == [expected[i] for i in ids]
    make_input(
        pattern, is_training=False, global_batch_size=10, label_offset=0, num_classes=NUM_CLASSES
    )
    with pytest.raises(
        ValueError,
        match=r"label_offset=1 disagrees with the label map .*labels\.json.*"
        r"label_offset=0",
    ):
        make_input(pattern, is_training=False, global_batch_size=10, label_offset=1)
    with pytest.raises(ValueError, match="num_classes=4 disagrees"):
        make_input(pattern, is_training=False, global_batch_size=10, num_classes=4)
    # A label map with one class too few: the records of the last class are out of range.
    # Skipped and counted by default (2 of 10 records: fewer than the floor of 10 bad records)...
    write_label_map(str(tmp_path), names[:-1], 0)
    inp = make_input(pattern, is_training=False, global_batch_size=10)
    assert sorted(collect(inp.dataset())[0]) == [i for i in expected if expected[i] < 4]
    assert inp.skipped_by_reason == {"label >= num_classes": 2}
    # ...and the first one stops a strict run.
    inp = make_input(pattern, is_training=False, global_batch_size=10, strict=True)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"(?s)train-00000-of-00001.*num_classes=4"
    ):
        list(inp.dataset())


def test_without_label_map_the_offset_defaults_to_one(records):
    inp = make_input(records[0], is_training=False, global_batch_size=4)
    assert (inp.label_map, inp.label_offset, inp.num_classes) == (None, 1, None)


# --------------------------------------------------------------------------------------------------
# TFDS and tf.data service


def test_tfds_mock_imagenet_uses_our_decode():
    tfds = pytest.importorskip("tensorflow_datasets")
    skip = {"image": tfds.decode.SkipDecoding()}
    with tfds.testing.mock_data(num_examples=10):
        raw = list(tfds.load("imagenet2012", split="validation", decoders=skip))
        # Counts given: the mock has no split metadata.
        counts = dict(train_examples=10, validation_examples=10)
        found = data.inputs("tfds:imagenet2012", image_size=16, global_batch_size=4, **counts)
        assert (found.label_offset, found.num_classes) == (0, 1000)
        batches = list(found.validation.dataset())
        train_images, train_labels = next(iter(found.train.dataset()))
    labels = np.concatenate([labels.numpy() for _, labels in batches])
    images = np.concatenate([images.numpy() for images, _ in batches])
    np.testing.assert_array_equal(labels, [int(example["label"]) for example in raw])
    expected = [
        image_ops.normalize_image(image_ops.decode_and_center_crop(example["image"], 16)).numpy()
        for example in raw
    ]
    np.testing.assert_allclose(images, np.stack(expected), atol=1e-5)
    assert train_images.shape == (4, 16, 16, 3) and train_labels.dtype == tf.int32


def test_tfds_pipelines_read_even_splits(monkeypatch):
    tfds = pytest.importorskip("tensorflow_datasets")
    requested = []
    original = tfds.core.DatasetBuilder.as_dataset

    def spy(self, split=None, **kwargs):
        requested.append(str(split))
        return original(self, split=split, **kwargs)

    monkeypatch.setattr(tfds.core.DatasetBuilder, "as_dataset", spy)
    with tfds.testing.mock_data(num_examples=4):
        counts = dict(train_examples=4, validation_examples=4)
        found = data.inputs("tfds:imagenet2012", image_size=16, global_batch_size=4, **counts)
        inp = found.validation
        for index in range(2):
            inp.dataset(context(index, 2))
    assert requested == [str(s) for s in tfds.even_splits("validation", n=2)]


def test_tfds_is_spelled_once_as_a_source_of_inputs():
    with pytest.raises(AttributeError, match=r'data\.inputs\("tfds:imagenet2012"'):
        ImageNetInput.from_tfds("imagenet2012", "train", is_training=True, global_batch_size=4)
    with pytest.raises(ValueError, match=r"data\.inputs\('tfds:imagenet2012'"):
        ImageNetInput("tfds:imagenet2012", is_training=True, global_batch_size=4)


@pytest.fixture(scope="module")
def data_service():
    service = tf.data.experimental.service
    dispatcher = service.DispatchServer(service.DispatcherConfig(port=0))
    address = dispatcher.target.split("://")[1]
    workers = [
        service.WorkerServer(service.WorkerConfig(dispatcher_address=address, port=0))
        for _ in range(2)
    ]
    yield dispatcher.target
    del workers, dispatcher


def test_data_service_eval_gives_each_example_once(records, data_service):
    pattern, expected = records
    inp = make_input(
        pattern, is_training=False, global_batch_size=8, data_service_address=data_service
    )
    ids, labels, _ = collect(inp.dataset())
    assert sorted(ids) == sorted(expected)


@pytest.mark.parametrize(
    "breakage,words",
    [("truncated", "is not a complete JPEG"), ("frame height 0", "holds an image the decoder")],
)
def test_data_service_fails_at_a_bad_record_naming_it(tmp_path, data_service, breakage, words):
    # The service's workers cannot report skipped records: the first bad record stops the run,
    # named like a skipped one, the decoder's rejects included.
    pattern, _ = write_coded_records(str(tmp_path), 2, 6, bad={8: BREAKAGES[breakage]})
    inp = make_input(
        pattern, is_training=False, global_batch_size=4, data_service_address=data_service
    )
    with pytest.raises(
        tf.errors.InvalidArgumentError,
        match=r"(?s)service the first bad record stops the run.*record 2 of \S*train-00001-of-00002 "
        + words,
    ):
        list(inp.dataset())


def test_data_service_train(records, data_service):
    pattern, expected = records
    inp = make_input(
        pattern,
        is_training=True,
        global_batch_size=8,
        shuffle_buffer_size=16,
        data_service_address=data_service,
    )
    # Two workers take file splits from the dispatcher as they go, so one pass over the 60 examples
    # is not 60 consecutive draws: 20 batches (2.7 passes) missed an example about one run in seven.
    ids, _, sizes = collect(inp.dataset(), num_batches=60)
    assert set(sizes) == {8} and set(ids) == set(expected)


# --------------------------------------------------------------------------------------------------
# The synthetic dataset


def test_synthetic_imagenet_is_deterministic_and_learnable(tmp_path):
    kwargs = dict(num_classes=4, train_examples=80, validation_examples=40, image_shape=(24, 24))
    first = make_synthetic_imagenet(str(tmp_path / "a"), **kwargs)
    make_synthetic_imagenet(str(tmp_path / "b"), **kwargs)
    for name in sorted(os.listdir(tmp_path / "a")):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    # The label map gives each file's record count, as the writer's does.
    counts = read_label_map(str(tmp_path / "a")).record_counts
    assert counts == {
        name: sum(1 for _ in tf.data.TFRecordDataset(str(tmp_path / "a" / name)))
        for name in os.listdir(tmp_path / "a")
        if "-of-" in name
    }
    assert sum(counts.values()) == 120

    def features_and_labels(pattern, is_training):
        inp = ImageNetInput(
            pattern,
            is_training=is_training,
            global_batch_size=40,
            image_size=16,
            config=InputConfig(deterministic=True),
        )
        images, labels = next(iter(inp.dataset()))
        return images.numpy().mean(axis=(1, 2)), labels.numpy()

    # Even a nearest-class-mean colour classifier learns it from random training crops.
    train_x, train_y = features_and_labels(first["train"], True)
    eval_x, eval_y = features_and_labels(first["validation"], False)
    means = np.stack([train_x[train_y == c].mean(axis=0) for c in range(4)])
    predicted = np.argmin(((eval_x[:, None] - means[None]) ** 2).sum(-1), axis=1)
    assert (predicted == eval_y).mean() > 0.9


@pytest.mark.parametrize("cache", [False, True])
def test_deterministic_stream_replays_from_every_new_iterator(records, cache):
    """A resumed run skips to where it stopped: every iterator must see the stream an earlier one
    saw."""
    pattern, _ = records
    inp = make_input(
        pattern, is_training=True, global_batch_size=5, cache=cache, deterministic=True, seed=7
    )
    dataset = inp.dataset()
    first = collect(dataset, num_batches=30)[0]
    second = collect(dataset, num_batches=30)[0]
    assert first == second
    epoch = len(set(first))
    assert first[:epoch] != first[epoch : 2 * epoch]  # epochs still come in new orders


# --------------------------------------------------------------------------------------------------
# Real images: scikit-learn's digits, written by the package's writer


@pytest.fixture(scope="module")
def digits(digits_records):
    """scikit-learn's digits as TFRecords; every record's digit index read back without the
    pipeline (from the file name the writer stores), in the evaluation order."""
    from sklearn.datasets import load_digits

    out = digits_records
    order = {}
    for split in ("train", "validation"):
        files = sorted(tf.io.gfile.glob(os.path.join(out, f"{split}-*")))
        # The evaluation order: one record of each file in turn (files sorted by name).
        readers = [iter(tf.data.TFRecordDataset(path)) for path in files]
        records = []
        while readers:
            for reader in list(readers):
                record = next(reader, None)
                if record is None:
                    readers.remove(reader)
                else:
                    records.append(record)
        order[split] = [
            int(
                tf.train.Example.FromString(record.numpy())
                .features.feature["image/filename"]
                .bytes_list.value[0]
                .decode()
                .split(".")[0]
            )
            for record in records
        ]
    return out, order, load_digits()


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_real_digits_come_out_in_order_with_their_labels(digits, dtype):
    """Evaluation: every digit once, in the files' order, with the label of its class folder, and
    each image closest to a picture of its label among all 1,797 digits."""
    out, order, data = digits
    inp = ImageNetInput(
        os.path.join(out, "validation-*"),
        is_training=False,
        global_batch_size=48,
        image_size=32,
        dtype=dtype,
    )
    batches = list(inp.dataset())
    labels = np.concatenate([labels.numpy() for _, labels in batches])
    np.testing.assert_array_equal(labels, data.target[order["validation"]])
    images = np.concatenate([images.numpy().astype(np.float32) for images, _ in batches])
    if dtype == "float32":
        images = images * image_ops.IMAGENET_STDDEV_RGB + image_ops.IMAGENET_MEAN_RGB
    # The evaluation crop of every digit, from its 8x8 pixels: the centre 28 of 32 (7/8), at 32x32.
    pictures = tf.image.resize(data.images[..., None] * (255.0 / 16.0), [32, 32])
    pictures = tf.image.resize(pictures[:, 2:30, 2:30], [32, 32]).numpy()[..., 0]
    distances = ((images.mean(axis=-1)[:, None] - pictures[None]) ** 2).mean(axis=(2, 3))
    nearest = np.argmin(distances, axis=1)
    np.testing.assert_array_equal(data.target[nearest], labels)


def test_real_digits_training_epoch_holds_every_label_once(digits):
    out, order, data = digits
    inp = ImageNetInput(
        os.path.join(out, "train-*"),
        is_training=True,
        global_batch_size=64,
        image_size=32,
        dtype="uint8",
        config=InputConfig(cache=True, deterministic=True, seed=1),
    )
    count = len(order["train"])
    labels = np.concatenate([labels.numpy() for _, labels in inp.dataset().take(count // 64 + 1)])[
        :count
    ]
    # With a cache each epoch is a permutation of the split: the same labels, in a new order.
    expected = data.target[order["train"]]
    np.testing.assert_array_equal(np.sort(labels), np.sort(expected))
    assert not np.array_equal(labels, expected)


def test_file_patterns_expand_the_home_folder(digits_records, monkeypatch):
    home, name = os.path.split(digits_records)
    monkeypatch.setenv("HOME", home)
    here = ImageNetInput(
        f"~/{name}/validation-*", is_training=False, image_size=16, global_batch_size=64
    )
    assert here.source.patterns == [os.path.join(digits_records, "validation-*")]
    assert here.num_classes == 10  # the label map was found through the expanded path


def test_pipelines_are_traced_without_autograph(tmp_path, monkeypatch):
    # AutoGraph's conversion of the pipeline's functions adds seconds to every run's start; each
    # function tf.data is given must be traced as written (`sources.graph_function`).
    from tensorflow.python.autograph.impl import api

    converted = []
    real = api.converted_call

    def recording(f, args, kwargs, caller_fn_scope=None, options=None):
        if (getattr(f, "__module__", None) or "").startswith("tpu_scale"):  # not TensorFlow's
            converted.append(getattr(f, "__qualname__", repr(f)))
        return real(f, args, kwargs, caller_fn_scope=caller_fn_scope, options=options)

    monkeypatch.setattr(api, "converted_call", recording)
    pattern, _ = write_coded_records(str(tmp_path), 2, 6)
    for is_training, cache in ((True, False), (False, False), (True, True)):
        inp = make_input(pattern, is_training=is_training, global_batch_size=4, cache=cache)
        next(iter(inp.dataset()))
    assert converted == [], converted
