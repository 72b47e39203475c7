"""Authenticated parameter servers: a bind beyond loopback needs a shared secret; with
one, every message is signed (HMAC-SHA256 over all frames), unsigned or badly signed
messages are dropped unanswered and counted, replays are dropped, and a signed run
trains exactly the model an unsigned one does."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import zmq

from psring.comm import endpoints, protocol
from psring.comm.endpoints import load_secret
from psring.comm.protocol import AuthenticationError, ProtocolError, decode, encode
from psring.errors import ConfigError, PsringError
from tests.helpers import (
    SMALL,
    LiveServer,
    RawClient,
    assert_no_processes,
    load_model,
    max_rel_diff,
    psring,
    read_steps,
    start_server_process,
)

KEY = b"k" * 32
OTHER = b"o" * 32
COMMON = {"run": "r", "worker": 0, "seq": 1, "shard": 0}


def env_without_secret() -> dict:
    env = dict(os.environ)
    env.pop(endpoints.SECRET_ENV, None)
    return env


def non_loopback_ip() -> str | None:
    """An address of this host that is not loopback (never bound: the refusal comes
    first), or None when the host has none."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent for a UDP connect
            ip = s.getsockname()[0]
    except OSError:
        return None
    return None if ip.startswith("127.") or ip == "0.0.0.0" else ip


# ---------------------------------------------------------------------- the secret
def test_load_secret_from_file_env_and_refusals(tmp_path, monkeypatch):
    monkeypatch.delenv(endpoints.SECRET_ENV, raising=False)
    assert load_secret("") is None and load_secret(None) is None
    f = tmp_path / "secret"
    f.write_text("  " + "x" * 40 + "\n")
    assert load_secret(f) == b"x" * 40
    monkeypatch.setenv(endpoints.SECRET_ENV, "y" * 20)
    assert load_secret("") == b"y" * 20
    assert load_secret(f) == b"x" * 40  # the file wins
    monkeypatch.setenv(endpoints.SECRET_ENV, "short")
    with pytest.raises(ConfigError, match="at least 16"):
        load_secret("")
    with pytest.raises(ConfigError, match="--secret-file .*nope"):
        load_secret(tmp_path / "nope")


@pytest.mark.parametrize("endpoint,local", [
    ("tcp://127.0.0.1:5555", True), ("tcp://localhost:1", True), ("tcp://[::1]:5", True),
    ("ipc:///tmp/x", True), ("tcp://0.0.0.0:5555", False), ("tcp://*:5555", False),
    ("tcp://10.1.2.3:5555", False), ("tcp://hostS:5555", False)])
def test_which_endpoints_need_a_secret(endpoint, local):
    assert endpoints.is_local(endpoint) is local


# ---------------------------------------------------------------------- refusing a bind
def test_server_refuses_non_loopback_bind_without_secret():
    from psring.runtime.process import free_port
    from psring.servers.server import Server

    for host in filter(None, ["0.0.0.0", non_loopback_ip()]):
        with pytest.raises(ConfigError, match="refusing to listen.*--secret-file.*PSRING_SECRET"):
            Server(f"tcp://{host}:{free_port()}", secret=None)


@pytest.mark.timeout(60)
def test_psring_server_beyond_loopback_without_secret_exits_2(tmp_path):
    from psring.runtime.process import free_port

    port = free_port()
    for cmd in (["-m", "psring", "server"], ["-m", "psring.servers"]):
        proc = subprocess.run([sys.executable, *cmd, "--bind", f"tcp://0.0.0.0:{port}",
                               "--name", "refused"], capture_output=True, text=True,
                              timeout=60, env=env_without_secret())
        assert proc.returncode == 2, proc.stderr
        assert "refusing to listen on tcp://0.0.0.0" in proc.stderr
        assert "--secret-file" in proc.stderr and "PSRING_SECRET" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert "listening" not in proc.stdout  # refused before binding anything
    # with a secret on loopback it starts, and says it signs
    f = tmp_path / "secret"
    f.write_text("s" * 32)
    p, endpoint = start_server_process("--secret-file", str(f), "--name", "signed-srv")
    try:
        assert endpoint.startswith("tcp://127.0.0.1:")
    finally:
        p.terminate()
        out, _ = p.communicate(timeout=10)
    assert p.returncode == 0 and "unauthenticated 0" in out
    assert_no_processes("signed-srv")


def test_run_config_refuses_remote_server_addrs_without_secret(monkeypatch, tmp_path):
    from psring.config import RunConfig, validate

    monkeypatch.delenv(endpoints.SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match="beyond loopback.*--secret-file"):
        validate(RunConfig(strategy="ps", workers=2, server_addrs="tcp://10.0.0.5:5555"))
    with pytest.raises(ConfigError, match="--secret-file"):
        validate(RunConfig(strategy="ps", workers=2, secret_file=str(tmp_path / "missing")))
    f = tmp_path / "secret"
    f.write_text("s" * 32)
    cfg = validate(RunConfig(strategy="ps", workers=2, server_addrs="tcp://10.0.0.5:5555",
                             secret_file=str(f)))
    assert "--secret-file" in cfg.to_argv()


# ---------------------------------------------------------------------- signatures
def _push(key, t=None):
    t = torch.arange(6, dtype=torch.float32) if t is None else t
    return [bytes(f) for f in encode("push", {**COMMON, "step": 0, "offset": 0}, [t], key)]


def test_signed_messages_round_trip_and_any_change_breaks_the_signature():
    two = [torch.ones(3), torch.zeros(3)]
    frames = [bytes(f) for f in encode("init", {**COMMON, "lo": 0, "hi": 3, "workers": 1,
                                                "mode": "sync", "lr": 0.1, "momentum": 0.0,
                                                "weight_decay": 0.0, "max_staleness": -1},
                                       two, KEY)]
    assert len(frames[1]) == protocol.SIGNATURE_BYTES
    assert decode(frames, key=KEY).op == "init"
    tampered = {
        "other secret": (frames, OTHER),
        "unsigned": ([frames[0], b"", *frames[2:]], KEY),
        "no signature frame": ([frames[0]], KEY),
        "tensor byte flipped": ([*frames[:2], b"\x01" + frames[2][1:], frames[3]], KEY),
        "tensors swapped": ([*frames[:2], frames[3], frames[2]], KEY),
        "tensor dropped": (frames[:3], KEY),
        "frame added": ([*frames, b""], KEY),
        "bytes moved between frames": ([*frames[:2], frames[2] + frames[3][:4],
                                        frames[3][4:]], KEY),
        "header changed": ([frames[0].replace(b"sync", b"asyn"), *frames[1:]], KEY),
        "signature truncated": ([frames[0], frames[1][:16], *frames[2:]], KEY),
        "signature too long": ([frames[0], frames[1] + b"\0", *frames[2:]], KEY),
    }
    for _name, (msg, key) in tampered.items():
        with pytest.raises(AuthenticationError):
            decode(msg, key=key)
    # a side without a secret refuses a signed message (it can't check it)
    with pytest.raises(ProtocolError, match="no shared secret"):
        decode(frames)


def test_unsigned_encoding_is_unchanged_apart_from_an_empty_signature_frame():
    frames = _push(None)
    assert frames[1] == b"" and len(frames) == 3
    assert decode(frames).op == "push"


# ---------------------------------------------------------------------- a live server
@pytest.mark.timeout(60)
def test_wrong_secret_and_unsigned_messages_are_dropped_and_counted(tmp_path):
    log = tmp_path / "servers.jsonl"
    with LiveServer(log, secret=KEY) as server, \
            RawClient(server.endpoint, KEY, run="good") as good, \
            RawClient(server.endpoint, OTHER, run="evil") as wrong, \
            RawClient(server.endpoint, None, run="evil") as unsigned:
        good.init(n=4)
        sent = 0
        for bad in (wrong, unsigned):
            for frames in (bad.frames("init", [torch.ones(4)], lo=0, hi=4, workers=1,
                                      mode="sync", lr=1.0, momentum=0.0, weight_decay=0.0,
                                      max_staleness=-1),
                           bad.frames("pull", min_version=0),
                           [b"garbage"], [b"\x80", b"x" * 32]):
                bad.send(frames)
                sent += 1
        for bad in (wrong, unsigned):
            assert bad.recv(timeout_ms=300) is None  # dropped: not answered at all
        # the valid client is still served, and its run was not replaced
        assert torch.equal(good.pull(0), torch.zeros(4))
        assert server.unauthenticated == sent and server.invalid == 0
        assert server.stats["unauthenticated"] == sent
    records = [json.loads(line) for line in log.read_text().splitlines()]
    dropped = [r for r in records if r["op"] == "unauthenticated"]
    assert dropped and dropped[-1]["count"] == sent
    assert any("bad signature" in r["error"] for r in dropped)
    assert any("unsigned" in r["error"] for r in dropped)
    (stats,) = [r for r in records if r["op"] == "stats"]
    assert stats["unauthenticated"] == sent


@pytest.mark.timeout(60)
def test_replayed_signed_messages_are_not_applied_twice(tmp_path):
    log = tmp_path / "servers.jsonl"
    with LiveServer(log, secret=KEY) as server, RawClient(server.endpoint, KEY) as c:
        init = c.frames("init", [torch.zeros(4)], lo=0, hi=4, workers=1, mode="sync",
                        lr=1.0, momentum=0.0, weight_decay=0.0, max_staleness=-1)
        c.send(init)
        assert decode(c.recv(), key=KEY).op == "ok"
        push0 = c.frames("push", [torch.ones(4)], step=0, offset=0)
        c.send(push0)
        ack = c.recv()
        # the same signed push again (a retry, or a replay of captured frames): answered
        # with the very same ack, not applied again
        c.send(push0)
        assert c.recv() == ack
        assert torch.equal(c.pull(1), -torch.ones(4))
        for step in (1, 2):
            assert c.request("push", [torch.ones(4)], step=step, offset=0).op == "ack"
        params = c.pull(3)
        assert torch.equal(params, -3 * torch.ones(4))
        # now push0 is older than the acks kept (this step's and the last): a replay,
        # dropped unanswered; so is a replayed init (it would reset the model) and any
        # replayed request whose seq is not new
        for frames in (push0, init, c.frames("pull", seq=3, min_version=0)):
            c.send(frames)
            assert c.recv(timeout_ms=300) is None
        assert torch.equal(c.pull(3), params)
        assert server.stats["replays"] == 3 and server.stats["retries"] == 1
        assert server.unauthenticated == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["op"] for r in records].count("replay") == 3
    assert [r["op"] for r in records].count("retry") == 1


@pytest.mark.timeout(60)
def test_client_names_the_server_whose_reply_fails_authentication():
    from psring.comm.psclient import PSClient

    # a server without the secret answers a signed request with an unsigned error
    with LiveServer() as server:
        client = PSClient([server.endpoint], run="r", worker=0, timeout=10, secret=KEY)
        try:
            key = client.send(0, "pull", {"min_version": 0})
            with pytest.raises(PsringError, match=f"from parameter server {server.endpoint} "
                                                  f"failed authentication.*unsigned"):
                client.wait([key], "a pull")
        finally:
            client.close()
    # a "server" signing with another secret
    ctx = zmq.Context()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    addr = f"tcp://127.0.0.1:{fake.bind_to_random_port('tcp://127.0.0.1')}"
    client = PSClient([addr], run="r", worker=0, timeout=10, secret=KEY)
    try:
        shard, seq = client.send(0, "leave", {})
        peer, *request = fake.recv_multipart()
        assert decode(request, key=KEY).op == "leave"
        fake.send_multipart([peer, *encode("ok", {"run": "r", "worker": 0, "seq": seq,
                                                  "shard": 0}, key=OTHER)])
        with pytest.raises(PsringError, match=f"{addr} failed authentication.*bad signature"):
            client.wait([(shard, seq)], "leaving")
    finally:
        client.close()
        fake.close(linger=0)
        ctx.term()


@pytest.mark.timeout(60)
def test_a_client_without_the_secret_times_out_with_a_hint():
    from psring.comm.psclient import PSClient

    with LiveServer(secret=KEY) as server:
        client = PSClient([server.endpoint], run="r", worker=0, timeout=1, secret=None)
        try:
            key = client.send(0, "pull", {"min_version": 0})
            with pytest.raises(PsringError, match="no answer.*drops unsigned messages"):
                client.wait([key], "a pull")
        finally:
            client.close()
        assert server.unauthenticated == 1


# ---------------------------------------------------------------------- a whole run
@pytest.mark.timeout(300)
def test_signed_ps_run_trains_the_same_model(small_runs, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    out = tmp_path / "signed"
    psring("run", "--strategy", "ps", "--workers", 2, *SMALL, "--secret-file", secret,
           "--out", out, env=env_without_secret())
    assert max_rel_diff(load_model(out), load_model(small_runs["single"])) < 1e-4
    assert len(read_steps(out)) == 24
    assert "(signed messages only)" in (out / "logs" / "server-0.log").read_text()
    records = [json.loads(line) for line in (out / "servers.jsonl").read_text().splitlines()]
    (stats,) = [r for r in records if r["op"] == "stats"]
    assert stats["unauthenticated"] == 0 and stats["invalid"] == 0
    assert stats["replays"] == 0 and stats["errors"] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["config"]["secret_file"] == str(secret)  # the path, never the secret
    assert secret.read_text() not in (out / "manifest.json").read_text()
    assert_no_processes(out)
