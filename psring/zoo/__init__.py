"""Model factories: psring's own (``simple``: mlp, cnn) and the seeds' workloads
(``vision``, ``text``), written in-project from their papers' layer tables.

torchvision cannot be installed beside torch 2.13's CPU build here, so ResNet, VGG and
Inception V3 are re-built to torchvision's exact layer shapes: at ``--classes 1000``
their parameter counts equal torchvision's (tests/multiproc/test_models.py checks).
``--width`` scales every layer's channels (64 = the paper's) so they fit a CPU.

    psring models                                  # every model at this run's sizes
    psring models --classes 1000 --image-size 224  # the papers' sizes
"""

from psring.zoo.base import KINDS, MODELS, Factory, Inputs, ModelSettings

# MODELS lists the models in the order they are imported here (kept, not sorted)
# isort: off
from psring.zoo import simple, vision, text  # noqa: F401 - imported to register the models
# isort: on

__all__ = ["KINDS", "MODELS", "Factory", "Inputs", "ModelSettings"]
