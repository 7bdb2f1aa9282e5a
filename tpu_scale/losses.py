"""Cross-entropy with label smoothing for integer (sparse) labels."""

import keras
from keras import ops


@keras.saving.register_keras_serializable(package="tpu_scale")
class SmoothedSparseCategoricalCrossentropy(keras.losses.Loss):
    """Cross-entropy between integer labels and predictions, with label smoothing.

    Equal to `keras.losses.CategoricalCrossentropy(label_smoothing=...)` on one-hot
    labels, without materializing the one-hot matrix, which at 1000 classes is as large
    as the logits. With `label_smoothing = s` and `K` classes the target of an example
    with label `y` is `1 - s + s / K` for class `y` and `s / K` for every other class, so

    ```python
    loss = (1 - s) * -log_p[y] + s * mean(-log_p)
    ```

    The loss is always computed in float32, also when the model runs under a
    `mixed_bfloat16` policy and hands over bfloat16 predictions.

    Example:

    ```python
    model.compile(optimizer=..., loss=SmoothedSparseCategoricalCrossentropy(),
                  metrics=["sparse_categorical_accuracy"])
    ```

    Args:
        label_smoothing: Float in `[0, 1)`. Defaults to `0.1`, the recipe's value.
        from_logits: Whether `y_pred` are logits (`True`, the default, for models
            whose last layer has no softmax) or probabilities.
        reduction: Type of reduction, as for every `keras.losses.Loss`. Defaults to
            `"sum_over_batch_size"`.
        name: Optional name of the loss.

    Call arguments:
        y_true: Integer class ids, shape `(batch,)` or `(batch, 1)`.
        y_pred: Logits or probabilities, shape `(batch, num_classes)`.
        sample_weight: Optional per-example weights.

    Reference:
        - [Szegedy et al., 2016](https://arxiv.org/abs/1512.00567) (label smoothing)
    """

    def __init__(
        self,
        label_smoothing=0.1,
        from_logits=True,
        reduction="sum_over_batch_size",
        name="smoothed_sparse_categorical_crossentropy",
    ):
        label_smoothing = float(label_smoothing)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"`label_smoothing` must be in [0, 1); received {label_smoothing}: use 0.1 for the recipe, 0.0 for none.")
        # The base class converts predictions to `dtype` before `call` and reduces in it:
        # float32, whatever the global policy, so that the softmax and its sums of a
        # thousand terms keep float32 precision.
        super().__init__(name=name, reduction=reduction, dtype="float32")
        self.label_smoothing = label_smoothing
        self.from_logits = bool(from_logits)

    def call(self, y_true, y_pred):
        y_pred = ops.cast(y_pred, "float32")
        labels = ops.cast(y_true, "int32")
        if len(labels.shape) == len(y_pred.shape):
            labels = ops.squeeze(labels, axis=-1)
        if self.from_logits:
            log_probs = ops.log_softmax(y_pred, axis=-1)
        else:
            # As Keras does for probabilities: renormalize, then clip away log(0).
            probs = y_pred / ops.sum(y_pred, axis=-1, keepdims=True)
            epsilon = keras.config.epsilon()
            log_probs = ops.log(ops.clip(probs, epsilon, 1.0 - epsilon))
        label_log_prob = ops.squeeze(
            ops.take_along_axis(log_probs, ops.expand_dims(labels, -1), axis=-1), axis=-1
        )
        s = self.label_smoothing
        loss = -(1.0 - s) * label_log_prob
        if s > 0:
            loss = loss - s * ops.mean(log_probs, axis=-1)
        return loss

    def get_config(self):
        config = super().get_config()
        config.update({"label_smoothing": self.label_smoothing, "from_logits": self.from_logits})
        return config
