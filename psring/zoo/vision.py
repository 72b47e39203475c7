"""ResNet (He et al., CVPR 2016) and VGG (Simonyan & Zisserman, ICLR 2015) as torchvision
builds them (ResNet v1.5: the stride of a bottleneck on its 3x3 convolution).

``--width W`` is the base channel count (64 in the papers): every stage's channels,
and VGG's 4096-unit classifier, scale by W/64. ``--image-size`` sets the synthetic
images' side (32 by default, CIFAR's; 224 is ImageNet's). As in torchvision, VGG's
classifier always sees its features average-pooled to 7x7, so at any image size most
of VGG's parameters are in its fully connected layers (low arithmetic intensity),
while ResNet's are in convolutions reused at every pixel.

Not kept from torchvision: VGG's Dropout layers. They hold no parameters, but their
random masks differ between processes, so a data-parallel run could not end with the
parameters of ``single`` (the synchronous-equivalence check). ResNet keeps its
BatchNorm; see docs/models.md for what each strategy does with the running statistics.
"""

from __future__ import annotations

from torch import nn

from ..errors import ConfigError
from .base import MODELS, Inputs, ModelSettings


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
