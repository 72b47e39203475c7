"""A model of your own, trained by every psring strategy: a worked example.

    psring run --model examples.my_model:build --strategy ps --workers 2 --steps 40
    psring run --model examples.my_model:build --data my_images.npz ...   # your data

``--model package.module:function`` imports ``package.module`` from the directory you
run psring in (or from anything installed) and calls ``function`` with the run's
:class:`psring.train.models.ModelSettings`. It returns the module and the
:class:`psring.train.models.Inputs` the module takes: psring then generates a learnable
synthetic data set of that shape (images here), or checks that a ``.npz`` given with
``--data`` has rows of that shape. Every worker calls it after seeding torch with
``--seed``, so all workers start from the same parameters.

The model may use any torch layers. This one normalizes with GroupNorm, not
BatchNorm: GroupNorm's statistics are per sample, so a data-parallel run ends with
exactly the parameters of ``single`` (BatchNorm's batch statistics differ with each
worker's slice of the batch; see docs/models.md).
"""

from torch import nn

from psring.train.models import Inputs, ModelSettings


def build(s: ModelSettings) -> tuple[nn.Module, Inputs]:
    width = s.width or 16  # --width, with a default of this model's choosing
    model = nn.Sequential(
        nn.Conv2d(s.channels, width, 3, padding=1), nn.GroupNorm(4, width), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.GroupNorm(4, 2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(2 * width, s.classes))
    return model, Inputs.image(s.channels, s.image_size, s.classes)
