"""The input pipeline's settings, in one frozen dataclass: `InputConfig`.

Everything that tunes how records become batches, and nothing about which data they are: the
augmentation (crops, flip, resize, scaled decode), the reading (interleave, buffers, cache,
threads), the order (determinism, seed), the tf.data service, the bad-record policy and the
validation's cache. `ImageNetInput(data, is_training=..., image_size=...,
global_batch_size=..., config=InputConfig(...))` and `data.inputs(..., config=...)` take it;
`Recipe.input_config(config)` puts the recipe's augmentation in one; `to_dict` / `from_dict` write
it as JSON in a run's record (the example's `run.json`) and read it back.
"""

import dataclasses
import functools

from tpu_scale.data.image_ops import AREA_RANGE, ASPECT_RATIOS, CENTER_CROP_FRACTION

RESIZE_METHODS = (
    "bilinear",
    "nearest",
    "bicubic",
    "area",
    "lanczos3",
    "lanczos5",
    "gaussian",
    "mitchellcubic",
)


@dataclasses.dataclass(frozen=True)
class InputConfig:
    """How `ImageNetInput` turns records into batches. Every field has a working default.

    Example:
        config = data.InputConfig(cache=True, deterministic=True, seed=0)
        train = data.ImageNetInput("/data/train-*", is_training=True, image_size=224,
                                   global_batch_size=1024, config=config)
        json.dump({"input_config": config.to_dict()}, f)   # InputConfig.from_dict reads it back

    Augmentation:
      crop_area_range: training: (min, max) fraction of the image area the Inception random box
        covers; `(0.08, 1.0)` is the ImageNet recipe's, a larger minimum augments less (small
        datasets, short runs); None trains on the whole image. `Recipe.input_config` gives one
        that fits the run.
      random_flip: training: mirror half of the images left to right.
      translate_fraction: training: after the crop and resize, shift the image by up to this
        fraction of its side in each direction (zero padding, then a random square of the
        original side: the CIFAR pad-and-crop translation; `image_ops.random_translate`). 0
        shifts nothing; 0.125 is CIFAR's 4 pixels at 32.
      center_crop_fraction: evaluation: the side of the center crop as a fraction of the short
        side (224 / 256 by default; 1.0 keeps a square image whole); with `aspect_ratio`
        "stretch" or "pad", the centred box's fraction of each side (1.0: the whole image).
      aspect_ratio: how an image that is not square becomes the square input, in training and
        evaluation alike: "crop" (the default, ImageNet's reference) takes its centred square
        and draws Inception's boxes; "stretch" resizes the whole image to the square, as Keras's
        `image_dataset_from_directory` does, and draws boxes of the image's own shape; "pad"
        keeps its shape and pads it to the square with zeros, as Keras's `pad_to_aspect_ratio`.
      resize_method: a `tf.image.ResizeMethod` name.
      scaled_decode: decode a crop window at least twice the output size (in both dimensions) at a
        libjpeg downscaling ratio of 2, 4 or 8 before the resize (`image_ops.decode_window`): less
        decode work for large photos, a measured PSNR bound against full-size decode + resize (see
        benchmarks/README.md).

    Reading:
      cycle_length: files read at once by the interleave (None: 64 TFRecord files, 16 TFDS files).
      read_buffer_bytes: read buffer of each TFRecord file reader (large buffers suit network file
        systems; the readers hold `cycle_length x read_buffer_bytes` of host memory).
      shuffle_buffer_size: raw records in the shuffle buffer (training). The file shuffle and the
        interleave already mix the data, so the reference recipe's 1024 (about 110 MB of ImageNet
        JPEGs) suffices.
      cache: keep the raw (encoded) records in host memory after the first epoch (training on full
        ImageNet needs about 150 GB; use it for datasets that fit).
      threadpool_size: threads of the pipeline's private pool, which decode in parallel (None: the
        host's CPU count).

    Order:
      deterministic: reproducible order and crops (slower). With `seed`, two runs give the same
        batches, and every new iterator replays the same stream (a resumed run sees what an
        uninterrupted one would have).
      seed: the seed of the file shuffle, the shuffle buffer and the crop seeds (None: 0 when
        `deterministic`, else unseeded).

    tf.data service:
      data_service_address: a dispatcher (`grpc://host:port`); the pipeline then runs on the
        service's workers, each file handed out once (dynamic sharding), and this host only
        receives batches. The workers cannot report bad records to this process: the first bad
        record stops the run, as with `strict`.
      data_service_job_name: share one service job between consumers (otherwise each `dataset()`
        call gets its own job).

    Bad records (a truncated file, a record that is not an Example, a missing feature or one of
    another type, a label out of range, bytes that are no complete image, an image the decoder
    rejects): skipped, named once each in the log (warnings of the "tpu_scale" logger) and counted
    (`ImageNetInput.skipped_records`, out of `records_read`).
      strict: stop at the first bad record, naming it.
      max_bad_fraction: the run stops, with an error naming the first bad records and the fix, when
        the bad records are more than this fraction of the records read and at least
        `bad_records.MIN_BAD_RECORDS_TO_STOP` (10).

    Records and batches:
      image_key: the feature holding the encoded image (None: "image/encoded" in TFRecords,
        "image" in TFDS).
      label_key: the feature holding the integer label (None: "image/class/label" in TFRecords,
        "label" in TFDS).
      cache_validation: the run's exact evaluation (`Inputs.exact_evaluation`) keeps its first pass
        over the validation split in host memory: True, False, or None for when one pass takes at
        most `evaluation.CACHE_LIMIT_BYTES` per input pipeline (`exact_evaluation`'s `cache`).
    """

    crop_area_range: tuple[float, float] | None = AREA_RANGE
    random_flip: bool = True
    translate_fraction: float = 0.0
    center_crop_fraction: float = CENTER_CROP_FRACTION
    aspect_ratio: str = "crop"
    resize_method: str = "bilinear"
    scaled_decode: bool = False
    cycle_length: int | None = None
    read_buffer_bytes: int = 8 * 1024 * 1024
    shuffle_buffer_size: int = 1024
    cache: bool = False
    threadpool_size: int | None = None
    deterministic: bool = False
    seed: int | None = None
    data_service_address: str | None = None
    data_service_job_name: str | None = None
    strict: bool = False
    max_bad_fraction: float = 0.001
    image_key: str | None = None
    label_key: str | None = None
    cache_validation: bool | None = None

    def __post_init__(self):
        area = self.crop_area_range
        if area is not None:
            area = tuple(float(a) for a in area)
            if len(area) != 2 or not 0 < area[0] <= area[1] <= 1:
                raise ValueError(f"crop_area_range={self.crop_area_range!r} must be (min, max) with 0 < min <= max <= 1, e.g. (0.08, 1.0) for ImageNet; None trains on the whole image.")
            object.__setattr__(self, "crop_area_range", area)
        if not 0 <= self.translate_fraction < 0.5:
            raise ValueError(f"translate_fraction={self.translate_fraction} must be in [0, 0.5): the largest shift as a fraction of the image side (0.125 is 4 pixels at 32); 0 shifts nothing.")
        if not 0 < self.center_crop_fraction <= 1:
            raise ValueError(f"center_crop_fraction={self.center_crop_fraction} must be in (0, 1]: 0.875 is the reference, 1.0 keeps the whole (square) image.")
        if self.aspect_ratio not in ASPECT_RATIOS:
            raise ValueError(f'aspect_ratio={self.aspect_ratio!r} must be one of {", ".join(ASPECT_RATIOS)}: "stretch" resizes the whole image to the square (Keras\'s default), "pad" pads it to the square, "crop" takes its centred square (ImageNet\'s).')
        if self.resize_method not in RESIZE_METHODS:
            raise ValueError(f"resize_method={self.resize_method!r} is not a tf.image.ResizeMethod; use one of {', '.join(RESIZE_METHODS)}.")
        if not 0 <= self.max_bad_fraction <= 1:
            raise ValueError(f"max_bad_fraction={self.max_bad_fraction} must be a fraction of the records read, in [0, 1] (0.001 stops a run when more than 0.1% of its records are bad).")
        for name in ("cycle_length", "threadpool_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be at least 1, or None for the default.")
        for name in ("read_buffer_bytes", "shuffle_buffer_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1.")

    def replace(self, **changes) -> "InputConfig":
        """A copy with `changes` (field names) applied, checked like a new one."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Every field by name, as JSON values (the crop range as a list)."""
        fields = dataclasses.asdict(self)
        if fields["crop_area_range"] is not None:
            fields["crop_area_range"] = list(fields["crop_area_range"])
        return fields

    @classmethod
    def from_dict(cls, fields: dict) -> "InputConfig":
        """The configuration `to_dict` gave (fields left out keep their defaults).

        Raises:
          ValueError: naming any key that is not a field.
        """
        _refuse_removed(fields)
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"Not InputConfig fields: {', '.join(unknown)}.")
        return cls(**fields)


FIELDS = frozenset(f.name for f in dataclasses.fields(InputConfig))

# Fields the configuration no longer has, each with the way that replaced it.
REMOVED_FIELDS = {
    "cache_evaluation": 'cache_evaluation is now cache_validation ("validation" names the data split): InputConfig(cache_validation=...).',
    "pad_last_batch": "pad_last_batch is gone: the exact evaluation fills the last batch of every replica with zero-weight examples (data.exact_evaluation, which data.inputs builds); compile the metrics as weighted_metrics.",
}


def _refuse_removed(fields):
    for name in fields:
        if name in REMOVED_FIELDS:
            raise TypeError(f"InputConfig: {REMOVED_FIELDS[name]}")


def _checked(init):
    @functools.wraps(init)
    def __init__(self, *args, **fields):
        _refuse_removed(fields)
        init(self, *args, **fields)

    return __init__


# The dataclass's own error for a field it no longer has would not say what replaced it.
InputConfig.__init__ = _checked(InputConfig.__init__)
