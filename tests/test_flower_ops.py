"""Operating the Flower deployment: key material, refusals, run-folder and report details.

Fast tests without Flower processes; the loopback ones are in ``tests/test_flower_deploy.py``.
"""

from __future__ import annotations

import logging
import stat
from pathlib import Path

from typer.testing import CliRunner

from fedfm.cli import app
from fedfm.errors import ConfigError
from fedfm.runtime.flower import deploy as D
from fedfm.runtime.flower import tls as T

runner = CliRunner()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def assert_key_modes(folder: Path) -> None:
    """Every private key in ``folder`` is 600, the folder 700, public files not writable by
    others."""
    assert _mode(folder) == 0o700, oct(_mode(folder))
    for p in folder.iterdir():
        if p.suffix == ".key":
            assert _mode(p) == 0o600, f"{p.name}: {oct(_mode(p))}"
        else:
            assert _mode(p) & 0o022 == 0, f"{p.name}: {oct(_mode(p))}"


def _certs(*args: str) -> object:
    return runner.invoke(app, ["flower-certs", *args])


def test_flower_certs_writes_private_keys_600_in_a_700_folder(tmp_path):
    out = tmp_path / "certs"
    res = _certs(str(out), "--nodes", "2")
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == [
        "ca.crt", "node0.key", "node0.pub", "node1.key", "node1.pub", "server.key", "server.pem"
    ]  # fmt: skip
    assert_key_modes(out)
    # The output says which file goes to which machine.
    assert "ca.crt" in res.output and "server.key never leaves it" in res.output


def test_flower_certs_refuses_to_replace_key_material_without_force(tmp_path):
    out = tmp_path / "certs"
    assert _certs(str(out), "--nodes", "1").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = _certs(str(out), "--nodes", "1")
    assert isinstance(res.exception, ConfigError), res.output
    assert "already holds key material" in str(res.exception) and "--force" in str(res.exception)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing changed
    # A lone node key is key material too.
    lone = tmp_path / "lone"
    T.make_node_key(lone, "node0")
    assert isinstance(_certs(str(lone)).exception, ConfigError)
    # --force replaces it, with the same modes.
    assert _certs(str(out), "--nodes", "1", "--force").exit_code == 0
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert after["ca.crt"] != before["ca.crt"] and after["node0.key"] != before["node0.key"]
    assert_key_modes(out)


def test_add_nodes_adds_keys_and_leaves_the_ca_and_certificate_alone(tmp_path):
    out = tmp_path / "certs"
    assert _certs(str(out), "--nodes", "2").exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = _certs(str(out), "--add-nodes", "2")
    assert res.exit_code == 0, res.output
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {k: after[k] for k in before} == before  # CA, certificate, old node keys kept
    assert sorted(set(after) - set(before)) == ["node2.key", "node2.pub", "node3.key", "node3.pub"]
    assert_key_modes(out)
    res = _certs(str(out), "--add-nodes", "1", "--force")
    assert isinstance(res.exception, ConfigError) and "add-nodes" in str(res.exception)
    assert isinstance(_certs(str(out), "--add-nodes", "0").exception, ConfigError)


def test_private_keys_are_never_world_readable_even_with_a_loose_umask(tmp_path):
    import os

    old = os.umask(0)
    try:
        tls = T.make_certificates(tmp_path / "c")
        priv, _ = T.make_node_key(tmp_path / "c", "node0")
    finally:
        os.umask(old)
    assert _mode(tls.server_key) == 0o600 and _mode(priv) == 0o600
    assert _mode(tmp_path / "c") == 0o700


def test_serve_and_client_warn_about_private_keys_readable_by_others(tmp_path, monkeypatch, caplog):
    out = tmp_path / "certs"
    assert _certs(str(out), "--nodes", "1").exit_code == 0
    monkeypatch.setattr(D, "serve", lambda cfg, **kw: {
        "name": cfg.name, "primary": "acc", "final": {"acc": 1.0}})  # fmt: skip
    monkeypatch.setattr(D, "client", lambda *a, **kw: 0)
    serve = ["serve", "tabular-fedavg", "--certificates", str(out)]
    client = ["client", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "1"]
    client += ["--root-certificates", str(out / "ca.crt"), "--auth-key", str(out / "node0.key")]
    with caplog.at_level(logging.WARNING, logger="fedfm"):
        assert runner.invoke(app, serve).exit_code == 0
        assert runner.invoke(app, client).exit_code == 0
    assert "readable by other users" not in caplog.text  # 600: no warning
    (out / "server.key").chmod(0o644)
    (out / "node0.key").chmod(0o640)
    with caplog.at_level(logging.WARNING, logger="fedfm"):
        assert runner.invoke(app, serve).exit_code == 0
        assert runner.invoke(app, client).exit_code == 0
    assert f"{out / 'server.key'} is readable by other users (mode 644)" in caplog.text
    assert f"{out / 'node0.key'} is readable by other users (mode 640)" in caplog.text


def test_client_refuses_insecure_with_an_auth_key_at_once(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(D, "client", lambda *a, **kw: started.append(a) or 0)
    key, _ = T.make_node_key(tmp_path, "node0")
    args = ["client", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "1"]
    res = runner.invoke(app, [*args, "--insecure", "--auth-key", str(key)])
    assert isinstance(res.exception, ConfigError) and not started
    assert "node authentication needs TLS" in str(res.exception)
    assert str(res.exception).startswith("config error: auth-key:")
