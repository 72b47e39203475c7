import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from psring.config import RunConfig, add_config_flags, config_from_args, validate
from psring.errors import ConfigError
from psring.registry import Registry


def test_defaults_are_valid_and_round_trip_through_flags():
    cfg = RunConfig(strategy="allreduce", workers=2, batch_size=64, lr=0.1, out="x")
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    assert config_from_args(parser.parse_args(cfg.to_argv())) == cfg
    assert cfg.per_worker_batch == 32
    traced = cfg.replace(trace=True)
    assert "--trace" in traced.to_argv() and "--no-trace" in cfg.to_argv()
    assert config_from_args(parser.parse_args(traced.to_argv())) == traced


def test_boolean_flags_take_no_value():
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    assert parser.parse_args(["--trace"]).trace is True
    assert parser.parse_args([]).trace is False
    with pytest.raises(SystemExit):  # "--trace False" must not mean True
        parser.parse_args(["--trace", "False"])


@pytest.mark.parametrize("kwargs, needle", [
    ({"strategy": "nope"}, "valid strategy names are: single, allreduce, ddp"),
    ({"model": "resnet9000"}, "valid model names are: mlp, cnn"),
    ({"workers": 0}, "--workers must be at least 1"),
    ({"strategy": "allreduce", "workers": 3, "batch_size": 64}, "try --batch-size 66"),
    ({"strategy": "single", "workers": 2}, "use --workers 1"),
    ({"lr": -1.0}, "--lr"),
    ({"momentum": 1.5}, "--momentum"),
    ({"accumulate": 0}, "--accumulate"),
    ({"bucket_mb": 0.0}, "--bucket-mb"),
    ({"data": "nothing.npz"}, "no such file"),
    ({"data": "imagenet"}, "synthetic, digits or a path"),
    ({"strategy": "allreduce", "workers": 2, "transport": "ipc"},
     "--transport applies to parameter-server strategies"),
    ({"strategy": "ps", "workers": 2, "transport": "tcp",
      "server_addrs": "tcp://127.0.0.1:5555"}, "drop --transport"),
    ({"strategy": "ps", "workers": 2, "transport": "ipc", "hosts": 2},
     "emulated hosts talk over their links"),
    ({"strategy": "ps", "workers": 2, "transport": "udp"}, "auto, tcp or ipc"),
])
def test_bad_config_names_the_fix(kwargs, needle):
    # each refused by RunConfig(...) (values) or else by validate (registries, files)
    with pytest.raises(ConfigError) as e:
        validate(RunConfig(**kwargs))
    assert needle in str(e.value)


@pytest.mark.parametrize("kwargs, needle", [
    ({"workers": 0}, "--workers must be at least 1"),
    ({"momentum": 1.5}, "--momentum"),
    ({"data": "imagenet"}, "synthetic, digits or a path"),
    ({"strategy": "ps", "workers": 2, "transport": "udp"}, "auto, tcp or ipc"),
    ({"strategy": "byteps", "workers": 2, "update_on": "gpu"}, "must be server or worker"),
    ({"compute": "device", "target_accuracy": 0.9}, "timing only"),
])
def test_values_are_refused_on_construction(kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        RunConfig(**kwargs)


def test_construction_needs_no_torch_and_validate_refuses_what_needs_it():
    # a fresh interpreter: this one imported torch long ago
    code = ("import sys\n"
            "from psring.config import RunConfig, validate\n"
            "cfg = RunConfig(model='resnet9000', data='nothing.npz', strategy='nope')\n"
            "assert 'torch' not in sys.modules, 'RunConfig imported torch'\n"
            "try:\n"
            "    validate(cfg)\n"
            "except Exception as e:\n"
            "    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("ConfigError") and "valid strategy names are" in out
    with pytest.raises(ConfigError, match="valid model names are"):
        validate(RunConfig(model="resnet9000"))
    with pytest.raises(ConfigError, match="no such file"):
        validate(RunConfig(data="nothing.npz"))


#: the order manifests have recorded a config's keys in since these flags exist
MANIFEST_ORDER = [
    "strategy", "workers", "model", "width", "depth", "data", "samples", "features",
    "classes", "image_size", "seq_len", "eval_samples", "eval_every", "target_accuracy",
    "batch_size", "steps", "accumulate", "lr", "momentum", "weight_decay", "seed", "device",
    "bucket_mb", "servers", "server_addrs", "transport", "secret_file", "max_staleness",
    "compress", "worker_batch", "reduce", "update_on", "hosts", "workers_per_host", "link",
    "delay", "server_placement", "slow_worker", "out", "timeout", "master_addr",
    "master_port", "threads", "checkpoint_every", "resume", "compute", "device_profile",
    "device_speed", "time_scale", "device_link", "trace", "kill_worker", "kill_server",
    "max_restarts", "backup_workers", "eliminate_every", "loss", "loss_burst", "loss_in",
    "tcp_rto_min", "link_buffer", "switch", "credit_window", "loss_tolerance"]


def test_derived_values_come_from_derived_and_reach_the_manifest():
    cfg = RunConfig(strategy="ps", workers=4, workers_per_host=2,
                    server_addrs="tcp://127.0.0.1:5555,tcp://127.0.0.1:5556",
                    compute="device", device_profile="p")
    # the fields keep what was given; what they decide is derived, never written back
    assert (cfg.hosts, cfg.servers, cfg.eval_samples) == (1, 1, 1024)
    assert cfg.derived() == {"hosts": 2, "servers": 2, "eval_samples": 0}
    recorded = cfg.to_dict()
    assert (recorded["hosts"], recorded["servers"], recorded["eval_samples"]) == (2, 2, 0)
    assert list(recorded) == MANIFEST_ORDER
    assert cfg.eval_interval == 0 and cfg.cluster.hosts == 2
    assert ["--hosts", "2"] == cfg.to_argv()[cfg.to_argv().index("--hosts"):][:2]
    valid = validate(RunConfig(strategy="allreduce", workers=4, workers_per_host=2))
    assert valid.hosts == 2 and validate(valid) is valid


def test_no_config_module_writes_into_the_frozen_dataclass():
    for path in Path("psring/config").glob("*.py"):
        assert "__setattr__" not in path.read_text(), path


def test_run_help_groups_the_flags_by_section(capsys):
    from psring.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--help"])
    text = capsys.readouterr().out
    titles = [line[:-1] for line in text.splitlines() if line.endswith(":")
              and not line.startswith(" ")]
    assert titles == ["options", "strategy", "model", "data", "evaluation", "optimization",
                      "device", "gradients", "servers", "cluster", "run", "faults", "links"]
    device = text[text.index("\ndevice:"):text.index("\ngradients:")]
    assert "--compute" in device and "--device-link" in device and "--lr" not in device
    assert "--trace" in text[text.index("\nrun:"):]


def test_cuda_without_cuda_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so --device cuda is valid here")
    cfg = RunConfig(device="cuda")  # a value: valid; CUDA is validate's to see
    with pytest.raises(ConfigError, match="no CUDA device"):
        validate(cfg)


def test_auto_device_resolves_to_what_torch_sees():
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert RunConfig().resolved_device == expected


def test_registry_rejects_duplicates_and_lists_names():
    reg = Registry("thing")
    reg.register("a")(object)
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("a")(int)
    with pytest.raises(ConfigError, match="valid thing names are: a"):
        reg.get("b")


def test_run_id_is_shared_within_a_launch_and_new_across_launches(monkeypatch):
    from psring.records.runlog import run_id

    cfg = RunConfig(out="runs/x")
    monkeypatch.setenv("PSRING_RUN_ID", "launch-1")
    a, b = run_id(cfg), run_id(cfg)
    monkeypatch.setenv("PSRING_RUN_ID", "launch-2")
    assert a == b != run_id(cfg)  # same --out, new launch: a new run for the servers
    # the hosts of one torchrun launch write to their own --out: one run all the same
    assert run_id(cfg.replace(out="/elsewhere/y")) == run_id(cfg)
    # a worker started alone, by hand: its --out is all there is
    monkeypatch.delenv("PSRING_RUN_ID")
    assert run_id(cfg.replace(out="runs/y")) != run_id(cfg)
