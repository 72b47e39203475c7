"""The model zoo: torchvision's parameter counts, and every model trained by the
strategies through `psring run` (multi-process, numbers checked)."""

import json

import pytest
import torch

from psring.errors import ConfigError
from psring.train.models import (
    MODELS,
    ModelSettings,
    build_model,
    flops_per_sample,
    parameter_count,
)
from tests.helpers import (
    assert_no_processes,
    load_model,
    max_rel_diff,
    psring,
    psring_together,
    read_evals,
)

#: torchvision's counts at 1000 classes (and 224x224, which the count does not depend on)
TORCHVISION = {"resnet18": 11_689_512, "resnet50": 25_557_032, "resnet101": 44_549_160,
               "vgg11": 132_863_336, "vgg16": 138_357_544,
               "inception_v3": 23_834_568}  # torchvision's with aux_logits=False


@pytest.mark.parametrize("name", TORCHVISION)
def test_parameter_counts_equal_torchvisions(name):
    with torch.device("meta"):  # shapes only: vgg16 would be 553 MB of float32
        model, inputs = build_model(name, ModelSettings(classes=1000, image_size=299), 0)
    assert parameter_count(model) == TORCHVISION[name]
    assert inputs.shape == (3, 299, 299)
    # and shrinking them for a CPU shrinks them: --width scales every layer
    with torch.device("meta"):
        small, _ = build_model(name, ModelSettings(classes=10, width=16, image_size=75), 0)
    assert parameter_count(small) < TORCHVISION[name] / 10


def test_every_model_runs_forward_and_backward_at_cpu_size():
    for name in MODELS:
        s = ModelSettings(width=16 if name not in ("mlp", "cnn", "gpt") else 0,
                          features=64, seq_len=8, image_size=MIN_SIDE.get(name, 32))
        model, inputs = build_model(name, s, 0)
        x = inputs.example(4)
        out = model(x)
        assert out.shape[-1] == s.classes, name
        if inputs.kind == "tokens":
            assert out.shape[:2] == (4, 8), name  # a prediction at every position
        assert flops_per_sample(model, inputs) > 0


def test_the_linear_svm_trains_on_its_hinge_loss():
    from psring.train.models import loss_for, loss_of

    model, inputs = build_model("svm", ModelSettings(features=8, classes=3), 0)
    assert inputs.kind == "vector" and parameter_count(model) == 8 * 3 + 3
    out, y = torch.tensor([[2.0, 0.5, 1.5]]), torch.tensor([0])
    # Weston-Watkins: mean over the other classes of max(0, 1 - (2.0 - score))
    assert loss_for(model)(out, y).item() == pytest.approx((0.0 + 0.5) / 3)
    assert loss_for(torch.nn.Linear(2, 2)) is loss_of  # others: cross-entropy
    with pytest.raises(ConfigError, match="--classes must be 2 or more"):
        build_model("svm", ModelSettings(classes=1), 0)


def test_model_factory_errors_name_the_fix(monkeypatch):
    monkeypatch.setitem(MODELS._items, "broken-for-test", lambda s: torch.nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="must return"):
        build_model("broken-for-test", ModelSettings(), 0)
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        build_model("examples.my_model:nope", ModelSettings(), 0)


#: the smallest image a model takes, where above the default 32 x 32
MIN_SIDE = {"inception_v3": 75}


def test_inception_v3_refuses_an_image_too_small_naming_the_fix():
    with pytest.raises(ConfigError, match="--image-size of at least 75"):
        build_model("inception_v3", ModelSettings(image_size=74), 0)


#: each model at a size that takes a second a step on one core
CPU_SIZES = {
    "resnet18": ["--width", "8"], "resnet50": ["--width", "8"],
    "vgg11": ["--width", "8"], "vgg16": ["--width", "8"],
    "mlstm": ["--width", "32", "--seq-len", "8"],
    "gpt": ["--width", "32", "--depth", "1", "--seq-len", "8"],
    "svm": [],
}
#: batch norm's batch statistics depend on each worker's slice of the batch, so these
#: do not end with single's parameters (docs/models.md); they are checked for training
BATCH_DEPENDENT = {"resnet18", "resnet50"}


@pytest.mark.timeout(300)
# one model of each builder through the CLI (resnet50 and vgg16 are resnet18's and
# vgg11's builders at other depths; every model's forward and backward is checked above)
@pytest.mark.parametrize("model", ["resnet18", "vgg11", "mlstm", "gpt", "svm"])
def test_model_trains_under_single_allreduce_and_ps(tmp_path, model):
    args = ["--model", model, *CPU_SIZES[model], "--batch-size", "8", "--steps", "3",
            "--samples", "64", "--eval-samples", "16", "--eval-every", "3", "--lr", "0.05"]
    runs = {}
    # batch-norm models are checked against their initial parameters, not single's
    runs_of = (("single", 1),) * (model not in BATCH_DEPENDENT) + (("allreduce", 2), ("ps", 2))
    psring_together(*(["run", "--strategy", strategy, "--workers", workers, *args,
                       "--out", tmp_path / strategy] for strategy, workers in runs_of),
                    timeout=200)
    for strategy, _ in runs_of:
        out = tmp_path / strategy
        runs[strategy] = load_model(out)
        evals = read_evals(out)
        assert [e["step"] for e in evals] == [0, 3]
        assert all(0 <= e["accuracy"] <= 1 and e["loss"] > 0 for e in evals)
        if model == "svm":  # its own loss, the hinge: about 1 at the start, not ln(10)
            assert evals[0]["loss"] < 1.2 and evals[-1]["loss"] < evals[0]["loss"], evals
    init = build_model(model, _settings(args), 0)[0].state_dict()
    for strategy, params in runs.items():  # training moved the parameters
        assert max_rel_diff(params, init) > 1e-4, strategy
    if model not in BATCH_DEPENDENT:  # synchronous SGD on the same global batch
        for strategy in ("allreduce", "ps"):
            assert max_rel_diff(runs[strategy], runs["single"]) < 1e-4, strategy
    assert_no_processes(tmp_path)


def _settings(args: list[str]) -> ModelSettings:
    kw = {}
    for flag, key in (("--width", "width"), ("--depth", "depth"), ("--seq-len", "seq_len"),
                      ("--image-size", "image_size")):
        if flag in args:
            kw[key] = int(args[args.index(flag) + 1])
    return ModelSettings(**kw)


@pytest.mark.timeout(300)
def test_a_user_factory_runs_under_every_kind_of_strategy(tmp_path):
    """examples/my_model.py through `--model package.module:factory`: the synchronous
    reference (ddp) ends with single's parameters, the asynchronous ones train."""
    args = ["--model", "examples.my_model:build", "--width", "8", "--image-size", "16",
            "--batch-size", "8", "--steps", "4", "--samples", "64", "--eval-samples", "16",
            "--eval-every", "2", "--lr", "0.05"]
    runs = (("single", 1), ("ddp", 2), ("async-ps", 2), ("hogwild", 2))
    psring_together(*(["run", "--strategy", strategy, "--workers", workers, *args,
                       "--out", tmp_path / strategy] for strategy, workers in runs),
                    timeout=200)
    for strategy, _ in runs:
        evals = read_evals(tmp_path / strategy)
        assert [e["step"] for e in evals] == [0, 2, 4]
    m = json.loads((tmp_path / "single" / "manifest.json").read_text())
    assert m["config"]["model"] == "examples.my_model:build"
    assert m["data"]["kind"] == "image" and m["data"]["shape"] == [3, 16, 16]
    single = load_model(tmp_path / "single")
    assert max_rel_diff(load_model(tmp_path / "ddp"), single) < 1e-4
    init = build_model("examples.my_model:build", ModelSettings(width=8, image_size=16),
                       0)[0].state_dict()
    for strategy in ("async-ps", "hogwild"):
        assert max_rel_diff(load_model(tmp_path / strategy), init) > 1e-4
    assert_no_processes(tmp_path)


def test_psring_models_shows_torchvisions_counts():
    out = psring("models", "--classes", "1000", "--image-size", "224", timeout=120).stdout
    for name, count in TORCHVISION.items():
        line = next(ln for ln in out.splitlines() if f" {name} " in ln)
        assert f"{count:,}" in line, line
    assert "mlstm" in out and "gpt" in out


def test_a_broken_user_factory_is_refused_before_any_process_starts(tmp_path, monkeypatch):
    """Config validation builds the model on the meta device and runs one forward pass
    on meta inputs of the declared shape: no memory, no compute, a clear error."""
    from psring.config import RunConfig, validate

    (tmp_path / "usermodels.py").write_text(
        "import torch\n"
        "from psring.train.models import Inputs\n"
        "def reads_values(s):\n"
        "    m = torch.nn.Linear(s.features, s.classes)\n"
        "    m.weight[0, 0].item()\n"
        "    return m, Inputs.vector(s.features, s.classes)\n"
        "def wrong_shape(s):\n"
        "    return torch.nn.Linear(s.features + 1, s.classes), "
        "Inputs.vector(s.features, s.classes)\n"
        "def fine(s):\n"
        "    return torch.nn.Linear(s.features, s.classes), Inputs.vector(s.features, s.classes)\n")
    monkeypatch.chdir(tmp_path)  # a factory is imported from the directory psring runs in
    with pytest.raises(ConfigError, match="without reading tensor values"):
        validate(RunConfig(model="usermodels:reads_values"))
    with pytest.raises(ConfigError, match="does not take the inputs its factory declares"):
        validate(RunConfig(model="usermodels:wrong_shape"))
    assert validate(RunConfig(model="usermodels:fine")).model == "usermodels:fine"


def test_sample_elimination_keeps_the_samples_inside_the_margin():
    from psring.train.data import Dataset
    from psring.train.elimination import Elimination, check_model

    model, _ = build_model("svm", ModelSettings(features=2, classes=2), 0)
    with torch.no_grad():
        model.linear.weight.copy_(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]))
        model.linear.bias.zero_()
    # margins 2x for class 0 at x = (x, 0): 4, 1, 0.4, -2
    train = Dataset(torch.tensor([[2.0, 0], [0.5, 0], [0.2, 0], [-1.0, 0]]),
                    torch.tensor([0, 0, 0, 0]), 2)
    kept = Elimination(train, every=5)
    assert kept.before_step(0, model, torch.device("cpu")) is train  # no check at 0
    assert kept.before_step(5, model, torch.device("cpu")).x[:, 0].tolist() == \
        pytest.approx([0.2, -1.0])
    assert kept.describe() == {"active": 0.5}
    assert len(kept.before_step(6, model, torch.device("cpu"))) == 2  # until the next check
    with torch.no_grad():  # the model moves: a sample eliminated falls inside the margin
        model.linear.weight.mul_(0.5)
    assert len(kept.before_step(7, model, torch.device("cpu"), resumed=True)) == 3
    with pytest.raises(ConfigError, match="use --model svm"):
        check_model(torch.nn.Linear(2, 2), 5)


@pytest.mark.timeout(120)
def test_sample_elimination_under_a_synchronous_strategy_stays_single(tmp_path):
    """Every worker scores the same parameters at a check, so keeps the same samples:
    allreduce and ps still end with single's parameters."""
    args = ["--model", "svm", "--batch-size", "16", "--steps", "12", "--samples", "256",
            "--eliminate-every", "3", "--lr", "0.05"]
    runs = (("single", 1), ("allreduce", 2), ("ps", 2))
    psring_together(*(["run", "--strategy", s, "--workers", w, *args, "--out", tmp_path / s]
                      for s, w in runs), timeout=100)
    single = load_model(tmp_path / "single")
    for s in ("allreduce", "ps"):
        assert max_rel_diff(load_model(tmp_path / s), single) < 1e-4, s
    steps = [json.loads(x) for x in (tmp_path / "ps" / "steps.jsonl").read_text().splitlines()]
    active = {r["step"]: r["active"] for r in steps}
    assert active[0] == 1.0 and min(active.values()) < 1.0  # samples left at a check
    assert_no_processes(tmp_path)
