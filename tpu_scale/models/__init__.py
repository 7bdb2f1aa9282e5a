"""Models of the recipe: ResNet-50 v1.5 and a small ResNet of the same structure.

Both are built with `tpu_scale.layers.DistributedBatchNormalization`, so that under a
strategy from `tpu_scale.create_strategy` their batch norms normalize over groups of
replicas, and both output float32 logits under a `mixed_bfloat16` policy. `load_model` reads a
saved one (the example's `final.keras`) back in a fresh process.
"""

from tpu_scale.models.loading import load_model
from tpu_scale.models.resnet import convert_stem, resnet50, small_resnet

__all__ = ["convert_stem", "load_model", "resnet50", "small_resnet"]
