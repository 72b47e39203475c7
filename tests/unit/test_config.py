import argparse

import pytest

from psring.config import RunConfig, add_config_flags, config_from_args
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
    with pytest.raises(ConfigError) as e:
        RunConfig(**kwargs)
    assert needle in str(e.value)


def test_cuda_without_cuda_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA, so --device cuda is valid here")
    with pytest.raises(ConfigError, match="no CUDA device"):
        RunConfig(device="cuda")


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
    from psring.runs.runlog import run_id

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
