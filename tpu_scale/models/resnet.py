"""ResNet-50 v1.5 and a small ResNet of the same structure, with grouped batch normalization."""

import numbers

import keras

from tpu_scale.layers import DistributedBatchNormalization, ImageNormalization, SpaceToDepth

# The batch-norm settings of the reference ResNet-50 on TPU pods.
_BN_MOMENTUM = 0.9
_BN_EPSILON = 1e-5
# From this image side up, `small_resnet`'s stem max-pools its output by 2, as ResNet-50's does,
# so that its first stage works at a quarter of the image's side (16x16 at 64 px) rather than at
# half: about a quarter of the multiply-adds an image. Small folders of 64-pixel images reach the
# same final top-1 with it, each threshold in about half the time (benchmarks/README.md, "The stem
# at 64 pixels"). Below it the stem's stride alone brings a 32-pixel image to 16x16.
POOLED_STEM_MIN_SIZE = 64


def resnet50(
    num_classes=1000,
    bn_group_size=None,
    input_shape=(224, 224, 3),
    kernel_regularizer=None,
    normalize_inputs=False,
    space_to_depth=False,
    name="resnet50",
    bn_virtual_batch_size=None,
):
    """Builds ResNet-50 v1.5, the model of the large-batch ImageNet recipe.

    Version 1.5 puts the stride of a downsampling bottleneck on its 3x3 convolution
    rather than on the first 1x1, which is slightly more accurate for the same parameter
    count: 25,557,032 trainable parameters at 1000 classes, plus 53,120 batch-norm
    moving statistics.

    Every batch norm is a `tpu_scale.layers.DistributedBatchNormalization` with
    momentum 0.9 and epsilon 1e-5, normalizing over groups of `bn_group_size` replicas.
    The last batch norm of each residual branch starts with gamma = 0, so each block
    starts as the identity: this is what makes the first, large-learning-rate steps of
    a large-batch run stable.

    The convolutions have no bias (the batch norm that follows has one) and He-normal
    initialization; the classifier is initialized with a small normal. The classifier
    runs in float32 (`dtype="float32"`), so under a `mixed_bfloat16` policy the logits
    are float32 while the convolutions run in bfloat16. The model outputs logits: use
    a loss with `from_logits=True`, e.g.
    `tpu_scale.losses.SmoothedSparseCategoricalCrossentropy`.

    Args:
        num_classes: Integer, the number of classes. Defaults to `1000`.
        bn_group_size: Integer or `None`, the number of replicas whose examples each
            batch norm normalizes together; it must divide the number of replicas. `1`
            gives per-replica statistics; `None` lets each layer pick the smallest group
            whose span (per-replica batch x group size) reaches 64 examples.
        bn_virtual_batch_size: Integer or `None`, examples per virtual batch of every batch
            norm (`DistributedBatchNormalization(virtual_batch_size=...)`): each run of that
            many examples of a replica's batch is normalized on its own. `None`: the whole
            replica's batch (or group's).
        input_shape: Shape of one image, channels last. Defaults to `(224, 224, 3)`.
        kernel_regularizer: Optional regularizer for every convolution and dense kernel.
            Leave it `None` with `tpu_scale.optimizers.LARS`, whose `weight_decay`
            already is the L2 term.
        normalize_inputs: Boolean. `True` takes uint8 pixels (`ImageNetInput(...,
            dtype="uint8")`) and normalizes them first thing, on the device, with
            `tpu_scale.layers.ImageNormalization`; `False` (the default) takes images
            the pipeline already normalized.
        space_to_depth: Boolean. `True` computes the 7x7 stride-2 stem as a 4x4
            stride-1 convolution on 2x2 space-to-depth blocks (`stem_conv` then has a
            `[4, 4, 12, 64]` kernel): the same function, better suited to TPU matrix
            units. `tpu_scale.models.convert_stem` converts weights both ways.
        name: Name of the model.

    Returns:
        A `keras.Model` from images to float32 logits of shape `(batch, num_classes)`.

    Reference:
        - [He et al., 2016](https://arxiv.org/abs/1512.03385)
        - [Goyal et al., 2017](https://arxiv.org/abs/1706.02677) (zero-initialized gamma)
        - [Ying et al., 2018](https://arxiv.org/abs/1811.06992)
    """
    return _resnet(
        input_shape=input_shape,
        num_classes=num_classes,
        stem=_space_to_depth_stem if space_to_depth else _imagenet_stem,
        stem_width=64,
        stages=((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)),
        block=_bottleneck_block,
        bn_group_size=bn_group_size,
        kernel_regularizer=kernel_regularizer,
        normalize_inputs=normalize_inputs,
        name=name,
        bn_virtual_batch_size=bn_virtual_batch_size,
    )


def small_resnet(
    num_classes,
    input_shape=(64, 64, 3),
    widths=(16, 32, 64),
    blocks_per_stage=None,
    bottleneck=False,
    bn_group_size=None,
    kernel_regularizer=None,
    normalize_inputs=False,
    name="small_resnet",
    bn_virtual_batch_size=None,
    stem_pool=None,
):
    """Builds a small ResNet of the same structure as `resnet50`, for CPU-sized runs.

    The same parts in the same places (convolution stem, residual stages whose first
    block downsamples with a stride on its 3x3 convolution and a projection shortcut,
    `DistributedBatchNormalization` after every convolution, zero-initialized gamma
    on the last batch norm of each residual branch, global average pooling, float32
    logits), but with a single 3x3 stride-2 convolution as stem (max-pooled by 2 more
    from `POOLED_STEM_MIN_SIZE` pixels up, as ResNet-50's stem is) and a few narrow
    stages. At the defaults (about 79 K parameters) it trains on 64x64 images on a
    laptop CPU in minutes.

    Args:
        num_classes: Integer, the number of classes.
        input_shape: Shape of one image, channels last, as for `resnet50`. Defaults to
            `(64, 64, 3)`.
        widths: Tuple of integers, the width of each stage (for bottleneck blocks, the
            inner width; the output is 4 times wider). Defaults to `(16, 32, 64)`.
        blocks_per_stage: Tuple of integers, the number of residual blocks of each
            stage. Defaults to one block per stage.
        bottleneck: Boolean. `True` uses ResNet-50's 1x1-3x3-1x1 bottleneck blocks;
            `False` (the default) basic blocks of two 3x3 convolutions.
        bn_group_size: Integer or `None`, as for `resnet50`.
        bn_virtual_batch_size: Integer or `None`, as for `resnet50`.
        kernel_regularizer: Optional kernel regularizer, as for `resnet50`.
        normalize_inputs: Boolean, as for `resnet50`: uint8 pixels in, normalized by
            the model's first layer.
        stem_pool: Boolean or `None`. `True` max-pools the stem's output by 2 (3x3 window,
            stride 2, as in `resnet50`), so the first stage works at a quarter of the
            image's side; `False` keeps it at half. `None` (the default) pools when the
            image's height and width are both at least `POOLED_STEM_MIN_SIZE` (64): at 64
            px that does about a quarter of the multiply-adds for the same top-1 on
            small folders of images. The pool has no weights, so weights saved with one choice
            load into the other.
        name: Name of the model.

    Returns:
        A `keras.Model` from `input_shape` images to float32 logits.
    """
    widths = tuple(widths)
    blocks_per_stage = (1,) * len(widths) if blocks_per_stage is None else tuple(blocks_per_stage)
    if len(widths) != len(blocks_per_stage) or not widths:
        raise ValueError(f"`widths` {widths} and `blocks_per_stage` {blocks_per_stage} must be non-empty and of the same length: one width and one block count per stage.")
    if min(widths) < 1 or min(blocks_per_stage) < 1:
        raise ValueError(f"Every stage needs a width >= 1 and at least one block; received widths={widths}, blocks_per_stage={blocks_per_stage}.")
    if len(input_shape) != 3 or min(input_shape[:2]) < 8:
        raise ValueError(f"`input_shape` must be (height, width, channels) with height and width at least 8; received {input_shape}.")
    if stem_pool not in (None, True, False):
        raise ValueError(f"`stem_pool` must be True, False or None (pool from {POOLED_STEM_MIN_SIZE} pixels up); received {stem_pool!r}.")
    if stem_pool is None:
        stem_pool = min(input_shape[:2]) >= POOLED_STEM_MIN_SIZE
    # The first stage keeps the stem's resolution, each later one halves it, as in ResNet-50.
    stages = tuple(
        (w, n, 1 if i == 0 else 2) for i, (w, n) in enumerate(zip(widths, blocks_per_stage))
    )
    return _resnet(
        input_shape=tuple(input_shape),
        num_classes=num_classes,
        stem=_pooled_small_stem if stem_pool else _small_stem,
        stem_width=widths[0],
        stages=stages,
        block=_bottleneck_block if bottleneck else _basic_block,
        bn_group_size=bn_group_size,
        kernel_regularizer=kernel_regularizer,
        normalize_inputs=normalize_inputs,
        name=name,
        bn_virtual_batch_size=bn_virtual_batch_size,
    )


def _resnet(
    input_shape,
    num_classes,
    stem,
    stem_width,
    stages,
    block,
    bn_group_size,
    kernel_regularizer,
    normalize_inputs,
    name,
    bn_virtual_batch_size=None,
):
    if (
        isinstance(num_classes, bool)
        or not isinstance(num_classes, numbers.Integral)
        or num_classes < 1
    ):
        raise ValueError(f"`num_classes` must be a positive integer; received {num_classes!r}.")
    layers = _Layers(bn_group_size, kernel_regularizer, bn_virtual_batch_size)
    inputs = keras.Input(
        shape=tuple(input_shape), dtype="uint8" if normalize_inputs else None, name="images"
    )
    x = ImageNormalization(name="normalize")(inputs) if normalize_inputs else inputs
    x = stem(layers, x, stem_width)
    for s, (width, num_blocks, stride) in enumerate(stages, start=1):
        for b in range(1, num_blocks + 1):
            x = block(layers, x, width, stride if b == 1 else 1, f"stage{s}_block{b}")
    x = keras.layers.GlobalAveragePooling2D(name="avg_pool")(x)
    # float32 whatever the policy: the logits and the softmax of the loss need its range.
    logits = keras.layers.Dense(
        num_classes,
        kernel_initializer=keras.initializers.RandomNormal(stddev=0.01),
        kernel_regularizer=kernel_regularizer,
        dtype="float32",
        name="logits",
    )(x)
    return keras.Model(inputs, logits, name=name)


class _Layers:
    """Makes the convolutions and batch norms of one model, with its shared settings."""

    def __init__(self, bn_group_size, kernel_regularizer, bn_virtual_batch_size=None):
        self.bn_group_size = bn_group_size
        self.bn_virtual_batch_size = bn_virtual_batch_size
        self.kernel_regularizer = kernel_regularizer

    def conv(self, x, filters, kernel_size, strides, name):
        padding = "same"
        if strides > 1 and kernel_size > 1:
            # Explicit symmetric padding: "same" would pad only the bottom and right at
            # stride 2, and which pixels a strided kernel sees would depend on the
            # parity of the input size.
            total = kernel_size - 1
            x = keras.layers.ZeroPadding2D(
                ((total // 2, total - total // 2),) * 2, name=f"{name}_pad"
            )(x)
            padding = "valid"
        return keras.layers.Conv2D(
            filters,
            kernel_size,
            strides=strides,
            padding=padding,
            use_bias=False,
            kernel_initializer="he_normal",
            kernel_regularizer=self.kernel_regularizer,
            name=name,
        )(x)

    def bn(self, x, name, zero_gamma=False):
        return DistributedBatchNormalization(
            group_size=self.bn_group_size,
            virtual_batch_size=self.bn_virtual_batch_size,
            momentum=_BN_MOMENTUM,
            epsilon=_BN_EPSILON,
            gamma_initializer="zeros" if zero_gamma else "ones",
            name=name,
        )(x)


def _imagenet_stem(layers, x, width):
    x = layers.conv(x, width, 7, 2, "stem_conv")
    x = layers.bn(x, "stem_bn")
    x = keras.layers.ReLU(name="stem_relu")(x)
    return keras.layers.MaxPooling2D(3, strides=2, padding="same", name="stem_pool")(x)


def _space_to_depth_stem(layers, x, width):
    # Equal to _imagenet_stem's convolution: see tpu_scale.layers.space_to_depth.
    x = SpaceToDepth(2, name="stem_space_to_depth")(x)
    x = keras.layers.ZeroPadding2D(((2, 1), (2, 1)), name="stem_conv_pad")(x)
    x = keras.layers.Conv2D(
        width,
        4,
        strides=1,
        padding="valid",
        use_bias=False,
        kernel_initializer="he_normal",
        kernel_regularizer=layers.kernel_regularizer,
        name="stem_conv",
    )(x)
    x = layers.bn(x, "stem_bn")
    x = keras.layers.ReLU(name="stem_relu")(x)
    return keras.layers.MaxPooling2D(3, strides=2, padding="same", name="stem_pool")(x)


def convert_stem(source, target):
    """Copies `source`'s weights into `target`, two ResNet-50s that differ only in their stem form.

    The `stem_conv` kernel is converted between the 7x7 stride-2 form and the space-to-depth 4x4
    form (whichever way the two models differ); every other weight is copied as it is, by layer
    name.

    Args:
      source: a `resnet50` model, standard or `space_to_depth=True`.
      target: a `resnet50` model of the other (or the same) stem form and otherwise the same
        settings.
    """
    from tpu_scale.layers.space_to_depth import (
        stem_kernel_from_space_to_depth,
        stem_kernel_to_space_to_depth,
    )

    for layer in target.layers:
        weights = source.get_layer(layer.name).get_weights() if layer.weights else []
        if layer.name == "stem_conv":
            have, want = weights[0].shape, tuple(layer.weights[0].shape)
            if have[:2] == (7, 7) and want[:2] == (4, 4):
                weights = [stem_kernel_to_space_to_depth(weights[0])]
            elif have[:2] == (4, 4) and want[:2] == (7, 7):
                weights = [stem_kernel_from_space_to_depth(weights[0])]
        if weights:
            layer.set_weights(weights)


def _small_stem(layers, x, width):
    x = layers.conv(x, width, 3, 2, "stem_conv")
    x = layers.bn(x, "stem_bn")
    return keras.layers.ReLU(name="stem_relu")(x)


def _pooled_small_stem(layers, x, width):
    x = _small_stem(layers, x, width)
    return keras.layers.MaxPooling2D(3, strides=2, padding="same", name="stem_pool")(x)


def _shortcut(layers, x, filters, stride, name):
    if stride == 1 and x.shape[-1] == filters:
        return x
    x = layers.conv(x, filters, 1, stride, f"{name}_shortcut_conv")
    return layers.bn(x, f"{name}_shortcut_bn")


def _bottleneck_block(layers, x, width, stride, name):
    shortcut = _shortcut(layers, x, 4 * width, stride, name)
    y = layers.conv(x, width, 1, 1, f"{name}_conv1")
    y = layers.bn(y, f"{name}_bn1")
    y = keras.layers.ReLU(name=f"{name}_relu1")(y)
    # v1.5: the stride is here, on the 3x3, not on the 1x1 above.
    y = layers.conv(y, width, 3, stride, f"{name}_conv2")
    y = layers.bn(y, f"{name}_bn2")
    y = keras.layers.ReLU(name=f"{name}_relu2")(y)
    y = layers.conv(y, 4 * width, 1, 1, f"{name}_conv3")
    y = layers.bn(y, f"{name}_bn3", zero_gamma=True)
    x = keras.layers.Add(name=f"{name}_add")([shortcut, y])
    return keras.layers.ReLU(name=f"{name}_out")(x)


def _basic_block(layers, x, width, stride, name):
    shortcut = _shortcut(layers, x, width, stride, name)
    y = layers.conv(x, width, 3, stride, f"{name}_conv1")
    y = layers.bn(y, f"{name}_bn1")
    y = keras.layers.ReLU(name=f"{name}_relu1")(y)
    y = layers.conv(y, width, 3, 1, f"{name}_conv2")
    y = layers.bn(y, f"{name}_bn2", zero_gamma=True)
    x = keras.layers.Add(name=f"{name}_add")([shortcut, y])
    return keras.layers.ReLU(name=f"{name}_out")(x)
