"""ResNet (He et al., CVPR 2016), VGG (Simonyan & Zisserman, ICLR 2015) and Inception V3
(Szegedy et al., CVPR 2016) as torchvision builds them (ResNet v1.5: the stride of a
bottleneck on its 3x3 convolution; Inception V3 without its auxiliary classifier).

``--width W`` is the base channel count (64 in the papers): every stage's channels,
and VGG's 4096-unit classifier, scale by W/64. ``--image-size`` sets the synthetic
images' side (32 by default, CIFAR's; 224 is ImageNet's). As in torchvision, VGG's
classifier always sees its features average-pooled to 7x7, so at any image size most
of VGG's parameters are in its fully connected layers (low arithmetic intensity),
while ResNet's are in convolutions reused at every pixel.

Not kept from torchvision: the Dropout layers of VGG and Inception V3. They hold no
parameters, but their random masks differ between processes, so a data-parallel run
could not end with the parameters of ``single`` (the synchronous-equivalence check).
ResNet and Inception V3 keep their BatchNorm; see docs/models.md for what each
strategy does with the running statistics. Inception V3 needs ``--image-size`` of at
least 75 (299 is its published size).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from psring.errors import ConfigError
from psring.zoo.base import MODELS, Inputs, ModelSettings


def _need_side(name: str, s: ModelSettings, least: int) -> None:
    if s.image_size < least:
        raise ConfigError(f"model {name} halves its input five times, so --image-size must "
                          f"be at least {least} (got {s.image_size}); try --image-size 32.")


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, planes * self.expansion, stride)

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + idt)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, planes * 4, stride)

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + idt)


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    def __init__(self, block, layers: list[int], classes: int, width: int, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = width
        stages = []
        for i, n in enumerate(layers):
            planes = width * 2 ** i
            blocks = []
            for j in range(n):
                blocks.append(block(cin, planes, 2 if (j == 0 and i > 0) else 1))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():  # torchvision's initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


@MODELS.register("resnet18")
def resnet18(s: ModelSettings):
    _need_side("resnet18", s, 8)
    return (ResNet(BasicBlock, [2, 2, 2, 2], s.classes, s.width or 64, s.channels),
            Inputs.image(s.channels, s.image_size, s.classes))


@MODELS.register("resnet50")
def resnet50(s: ModelSettings):
    _need_side("resnet50", s, 8)
    return (ResNet(Bottleneck, [3, 4, 6, 3], s.classes, s.width or 64, s.channels),
            Inputs.image(s.channels, s.image_size, s.classes))


@MODELS.register("resnet101")
def resnet101(s: ModelSettings):
    # Horovod's published scaling (October 2017) has it beside Inception V3 and VGG-16
    _need_side("resnet101", s, 8)
    return (ResNet(Bottleneck, [3, 4, 23, 3], s.classes, s.width or 64, s.channels),
            Inputs.image(s.channels, s.image_size, s.classes))


#: channels per 3x3 convolution, "M" a 2x2 max-pool (the paper's configurations A and D)
VGG_CONFIGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(self, config: list, classes: int, width: int, channels: int):
        super().__init__()
        layers: list[nn.Module] = []
        c = channels
        for v in config:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                out = v * width // 64
                layers += [nn.Conv2d(c, out, 3, padding=1), nn.ReLU(inplace=True)]
                c = out
        self.features = nn.Sequential(*layers)
        # torchvision pools to 7x7 whatever the input (a 32x32 image's 1x1 features are
        # repeated): the classifier, and so VGG's weight in fully connected layers, does
        # not depend on the image size
        pool = 7
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        hidden = 4096 * width // 64
        self.classifier = nn.Sequential(
            nn.Linear(c * pool * pool, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True),
            nn.Linear(hidden, classes))
        for m in self.modules():  # torchvision's initialization
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


def _vgg(name: str):
    def factory(s: ModelSettings):
        _need_side(name, s, 32)
        return (VGG(VGG_CONFIGS[name], s.classes, s.width or 64, s.channels),
                Inputs.image(s.channels, s.image_size, s.classes))

    factory.__name__ = name
    return MODELS.register(name)(factory)


vgg11 = _vgg("vgg11")
vgg16 = _vgg("vgg16")


# -- Inception V3 (Szegedy et al., CVPR 2016), as torchvision's Inception3 -------------
# Without the auxiliary classifier (torchvision's aux_logits=False: 23,834,568
# parameters at 1000 classes; the auxiliary head adds 3,326,696 and only trains) and
# without the Dropout before the classifier (as in VGG: the masks would differ between
# processes). Horovod's October 2017 scaling table has it beside ResNet-101 and VGG-16.

class _Conv(nn.Sequential):
    """torchvision's BasicConv2d: convolution without bias, batch norm, ReLU."""

    def __init__(self, cin: int, cout: int, kernel, stride=1, padding=0):
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, padding, bias=False),
                         nn.BatchNorm2d(cout, eps=0.001), nn.ReLU(inplace=True))


class _Branches(nn.Module):
    """Branches run on one input, their outputs concatenated along the channels; a
    branch named ``pool`` is an average (or, with ``max_pool``, max) pool first."""

    def __init__(self, max_pool: bool = False, **branches: nn.Module):
        super().__init__()
        self.max_pool = max_pool
        self.branches = nn.ModuleDict(branches)

    def forward(self, x):
        outs = []
        for name, branch in self.branches.items():
            if name == "pool":
                p = F.max_pool2d(x, 3, 2) if self.max_pool else F.avg_pool2d(x, 3, 1, 1)
                outs.append(branch(p))
            else:
                outs.append(branch(x))
        return torch.cat(outs, 1)


def _inception_a(c, cin: int, pool: int) -> _Branches:
    return _Branches(
        b1x1=_Conv(cin, c(64), 1),
        b5x5=nn.Sequential(_Conv(cin, c(48), 1), _Conv(c(48), c(64), 5, padding=2)),
        b3x3dbl=nn.Sequential(_Conv(cin, c(64), 1), _Conv(c(64), c(96), 3, padding=1),
                              _Conv(c(96), c(96), 3, padding=1)),
        pool=_Conv(cin, c(pool), 1))


def _inception_b(c, cin: int) -> _Branches:
    return _Branches(
        max_pool=True,
        b3x3=_Conv(cin, c(384), 3, stride=2),
        b3x3dbl=nn.Sequential(_Conv(cin, c(64), 1), _Conv(c(64), c(96), 3, padding=1),
                              _Conv(c(96), c(96), 3, stride=2)),
        pool=nn.Identity())


def _inception_c(c, cin: int, c7: int) -> _Branches:
    def row(a, b):  # a 1x7 convolution
        return _Conv(a, b, (1, 7), padding=(0, 3))

    def col(a, b):  # a 7x1 convolution
        return _Conv(a, b, (7, 1), padding=(3, 0))

    return _Branches(
        b1x1=_Conv(cin, c(192), 1),
        b7x7=nn.Sequential(_Conv(cin, c(c7), 1), row(c(c7), c(c7)), col(c(c7), c(192))),
        b7x7dbl=nn.Sequential(_Conv(cin, c(c7), 1), col(c(c7), c(c7)), row(c(c7), c(c7)),
                              col(c(c7), c(c7)), row(c(c7), c(192))),
        pool=_Conv(cin, c(192), 1))


def _inception_d(c, cin: int) -> _Branches:
    return _Branches(
        max_pool=True,
        b3x3=nn.Sequential(_Conv(cin, c(192), 1), _Conv(c(192), c(320), 3, stride=2)),
        b7x7x3=nn.Sequential(_Conv(cin, c(192), 1),
                             _Conv(c(192), c(192), (1, 7), padding=(0, 3)),
                             _Conv(c(192), c(192), (7, 1), padding=(3, 0)),
                             _Conv(c(192), c(192), 3, stride=2)),
        pool=nn.Identity())


class _Split(nn.Module):
    """InceptionE's expanded branches: one stem, then a 1x3 and a 3x1 convolution side
    by side, concatenated."""

    def __init__(self, stem: nn.Module, cin: int, cout: int):
        super().__init__()
        self.stem = stem
        self.a = _Conv(cin, cout, (1, 3), padding=(0, 1))
        self.b = _Conv(cin, cout, (3, 1), padding=(1, 0))

    def forward(self, x):
        x = self.stem(x)
        return torch.cat([self.a(x), self.b(x)], 1)


def _inception_e(c, cin: int) -> _Branches:
    return _Branches(
        b1x1=_Conv(cin, c(320), 1),
        b3x3=_Split(_Conv(cin, c(384), 1), c(384), c(384)),
        b3x3dbl=_Split(nn.Sequential(_Conv(cin, c(448), 1),
                                     _Conv(c(448), c(384), 3, padding=1)), c(384), c(384)),
        pool=_Conv(cin, c(192), 1))


class InceptionV3(nn.Module):
    def __init__(self, classes: int, width: int, channels: int):
        super().__init__()

        def c(n: int) -> int:  # --width scales every layer's channels by W/64
            return max(1, n * width // 64)

        self.stem = nn.Sequential(
            _Conv(channels, c(32), 3, stride=2), _Conv(c(32), c(32), 3),
            _Conv(c(32), c(64), 3, padding=1), nn.MaxPool2d(3, 2),
            _Conv(c(64), c(80), 1), _Conv(c(80), c(192), 3), nn.MaxPool2d(3, 2))
        blocks = [_inception_a(c, c(192), 32)]
        blocks.append(_inception_a(c, out := c(64) + c(64) + c(96) + c(32), 64))
        blocks.append(_inception_a(c, out := c(64) + c(64) + c(96) + c(64), 64))
        blocks.append(_inception_b(c, out))
        out = c(384) + c(96) + out
        for c7 in (128, 160, 160, 192):
            blocks.append(_inception_c(c, out, c7))
            out = 4 * c(192)
        blocks.append(_inception_d(c, out))
        out = c(320) + c(192) + out
        blocks.append(_inception_e(c, out))
        out = c(320) + 4 * c(384) + c(192)
        blocks.append(_inception_e(c, out))
        self.blocks = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(out, classes)
        for m in self.modules():  # torchvision's initialization
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.trunc_normal_(m.weight, mean=0.0, std=0.1, a=-2, b=2)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.fc(self.avgpool(self.blocks(self.stem(x))).flatten(1))


@MODELS.register("inception_v3")
def inception_v3(s: ModelSettings):
    # its stem and two stride-2 reductions without padding need 75 x 75 (torchvision's
    # minimum); the published figures are at 299 x 299
    if s.image_size < 75:
        raise ConfigError(f"model inception_v3 needs --image-size of at least 75 (got "
                          f"{s.image_size}); its published figures are at 299.")
    return (InceptionV3(s.classes, s.width or 64, s.channels),
            Inputs.image(s.channels, s.image_size, s.classes))
