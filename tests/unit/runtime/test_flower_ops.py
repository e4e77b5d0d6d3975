"""Operating the Flower deployment: key material, refusals, run-folder and report details.

Fast tests without Flower processes; the loopback ones are in
``tests/integration/test_flower_deploy.py``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedfm.cli import app
from fedfm.errors import ConfigError
from fedfm.runtime.flower import deploy as D
from fedfm.runtime.flower import deploy_client as DC
from fedfm.runtime.flower import processes as P
from fedfm.runtime.flower import refusals as R
from fedfm.runtime.flower import tls as T
from helpers.keys import assert_key_modes, mode

runner = CliRunner()


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
    assert mode(tls.server_key) == 0o600 and mode(priv) == 0o600
    assert mode(tmp_path / "c") == 0o700


def test_serve_and_client_warn_about_private_keys_readable_by_others(tmp_path, monkeypatch, caplog):
    out = tmp_path / "certs"
    assert _certs(str(out), "--nodes", "1").exit_code == 0
    monkeypatch.setattr(D, "serve", lambda cfg, **kw: {
        "name": cfg.name, "primary": "acc", "final": {"acc": 1.0}, "rounds": 2})  # fmt: skip
    monkeypatch.setattr(DC, "client", lambda *a, **kw: 0)
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
    monkeypatch.setattr(DC, "client", lambda *a, **kw: started.append(a) or 0)
    key, _ = T.make_node_key(tmp_path, "node0")
    args = ["client", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "1"]
    res = runner.invoke(app, [*args, "--insecure", "--auth-key", str(key)])
    assert isinstance(res.exception, ConfigError) and not started
    assert "node authentication needs TLS" in str(res.exception)
    assert str(res.exception).startswith("config error: auth-key:")


def _expiry(path: Path):
    from cryptography import x509

    return x509.load_pem_x509_certificate(path.read_bytes()).not_valid_after_utc


def test_flower_certs_last_the_days_asked_and_say_until_when(tmp_path):
    import datetime as dt

    out = tmp_path / "certs"
    res = _certs(str(out), "--nodes", "1")
    assert res.exit_code == 0, res.output
    end = _expiry(out / "server.pem")
    left = end - dt.datetime.now(dt.UTC)
    assert dt.timedelta(days=364) < left <= dt.timedelta(days=365)  # a year by default
    assert _expiry(out / "ca.crt") == end
    assert f"valid until {end:%Y-%m-%d %H:%M} UTC (365 days)" in res.output
    from cryptography import x509

    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    assert "test" not in ca.subject.rfc4514_string()
    res = _certs(str(tmp_path / "short"), "--days", "30")
    left = _expiry(tmp_path / "short" / "server.pem") - dt.datetime.now(dt.UTC)
    assert dt.timedelta(days=29) < left <= dt.timedelta(days=30)
    assert isinstance(_certs(str(tmp_path / "x"), "--days", "0").exception, ConfigError)


def test_renew_replaces_the_certificates_and_keeps_hosts_and_node_keys(tmp_path):
    out = tmp_path / "certs"
    args = ["--host", "server.example.org", "--host", "10.0.0.5", "--nodes", "2", "--days", "20"]
    assert _certs(str(out), *args).exit_code == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    res = _certs(str(out), "--renew")
    assert res.exit_code == 0, res.output
    after = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(after) == sorted(before)
    for name in ("node0.key", "node0.pub", "node1.key", "node1.pub"):
        assert after[name] == before[name], name  # node keys: nothing to register again
    for name in ("ca.crt", "server.pem", "server.key"):
        assert after[name] != before[name], name
    assert T.certificate_hosts(out / "server.pem") == [
        "server.example.org", "10.0.0.5", "127.0.0.1", "localhost"
    ]  # fmt: skip
    assert "(365 days)" in res.output and "node keys are unchanged" in res.output
    assert_key_modes(out)
    assert isinstance(_certs(str(tmp_path / "none"), "--renew").exception, ConfigError)
    assert isinstance(_certs(str(out), "--renew", "--nodes", "1").exception, ConfigError)


def test_serve_and_client_refuse_an_expired_certificate_and_warn_before_it_expires(
    tmp_path, monkeypatch, caplog
):
    """A certificate made to expire (validity in the past): one line, exit 2, nothing
    started; one that expires within 14 days: a warning, and the command goes on."""
    import datetime as dt

    started = []
    monkeypatch.setattr(D, "serve", lambda cfg, **kw: started.append("serve") or {
        "name": cfg.name, "primary": "acc", "final": {"acc": 1.0}, "rounds": 2})  # fmt: skip
    monkeypatch.setattr(DC, "client", lambda *a, **kw: started.append("client") or 0)
    now = dt.datetime.now(dt.UTC)
    T.make_certificates(tmp_path / "old", start=now - dt.timedelta(days=40), days=30)
    T.make_certificates(tmp_path / "soon", days=7)
    serve = lambda d: ["serve", "tabular-fedavg", "--certificates", str(tmp_path / d)]  # noqa: E731
    client = lambda d: [  # noqa: E731
        "client", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "1",
        "--root-certificates", str(tmp_path / d / "ca.crt"),
    ]  # fmt: skip
    for argv, field in ((serve("old"), "certificates"), (client("old"), "root-certificates")):
        res = runner.invoke(app, argv)
        assert isinstance(res.exception, ConfigError) and not started, res.output
        line = str(res.exception)
        assert line.startswith(f"config error: {field}: certificate {tmp_path / 'old'}/")
        assert " expired on " in line and "--renew" in line and "\n" not in line
    with caplog.at_level(logging.WARNING, logger="fedfm"):
        assert runner.invoke(app, serve("soon")).exit_code == 0
        assert runner.invoke(app, client("soon")).exit_code == 0
    assert started == ["serve", "client"]
    warned = [r.getMessage() for r in caplog.records if "expires on" in r.getMessage()]
    assert len(warned) == 3  # the server's CA and certificate, the client's CA
    assert all("(in 7.0 days)" in w and "--renew" in w for w in warned)


def test_an_expired_certificate_through_the_entry_point_is_one_line_and_exit_2(tmp_path):
    """The real process: status 2, one line on stderr, no traceback."""
    import datetime as dt

    start = dt.datetime.now(dt.UTC) - dt.timedelta(days=2)
    T.make_certificates(tmp_path / "old", start=start, days=1)
    out = subprocess.run(
        [sys.executable, "-m", "fedfm", "serve", "tabular-fedavg", "--certificates",
         str(tmp_path / "old"), "--port", str(P.free_port())],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and " expired on " in out.stderr
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- refusals

UNREGISTERED_LOG = """\
INFO:     Uvicorn running on http://127.0.0.1:59529 (Press CTRL+C to quit)
ERROR :     Exit Code: 305
Failed to initialize the connection to the SuperLink.
[code: 2004] Failed to activate SuperNode.
The SuperNode could not establish a connection to the SuperLink.
"""  # a SuperNode whose key is not registered (flwr 1.42, as logged here)


def test_flower_refusals_read_from_the_supernode_log():
    r = R.from_supernode_log(UNREGISTERED_LOG)
    assert r is not None and not r.fatal
    assert r.line() == (
        "refused: node key not registered on the SuperLink"
        " (Flower: [code: 2004] Failed to activate SuperNode.)"
    )
    no_key = UNREGISTERED_LOG.replace(
        "2004] Failed to activate SuperNode.",
        "2001] SuperNode authentication is enabled. All SuperNodes must be registered via the CLI.",
    )
    r = R.from_supernode_log(no_key)
    assert r is not None and r.fatal and "start this client with --auth-key" in r.reason
    assert R.from_supernode_log("WARNING :   Connection attempt failed, retrying in 3 s") is None


@contextmanager
def _server(tls: T.TlsFiles | None) -> Iterator[str]:
    """A loopback port that accepts connections, with TLS from ``tls`` or without."""
    import socket
    import ssl

    sock = socket.create_server(("127.0.0.1", 0))
    ctx = None
    if tls is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls.server_cert, tls.server_key)
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            with contextlib.suppress(OSError, ssl.SSLError):
                if ctx is not None:
                    conn.settimeout(2)
                    conn = ctx.wrap_socket(conn, server_side=True)
                else:
                    conn.recv(1024)  # a plain server: TLS bytes are not what it expects
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        t.join(5)
        sock.close()


def test_probe_tells_a_tls_mismatch_from_a_superlink_that_is_not_up(tmp_path):
    tls = T.make_certificates(tmp_path / "a")
    other = T.make_certificates(tmp_path / "b")
    with _server(tls) as address:
        r = R.probe(address, None)
        assert isinstance(r, R.Refusal) and r.fatal
        assert r.line() == (
            "refused: the SuperLink requires TLS: start this client with --root-certificates"
            " CA_FILE"
        )
        assert R.probe(address, tls.ca_cert) is None
        r = R.probe(address, other.ca_cert)
        assert isinstance(r, R.Refusal) and "does not verify against" in r.reason
    with _server(None) as address:
        assert R.probe(address, None) is None
        r = R.probe(address, tls.ca_cert)
        assert isinstance(r, R.Refusal) and "does not use TLS" in r.reason
    waiting = R.probe(address, None)  # closed now: nothing listens, so keep waiting
    assert isinstance(waiting, str) and waiting.startswith("nothing answers at")


def _fake_supernodes(monkeypatch, *logs: str) -> list[int]:
    """Replaces the SuperNode by a process that prints the next of ``logs`` (the last one
    again once they run out) and stays up 30 s unless the log ends with ``EXIT``. Returns
    the list that counts the starts."""
    starts: list[int] = []

    def fake_start(superlink, pid, n, home, log_dir, *a, **kw):
        text = logs[min(len(starts), len(logs) - 1)]
        starts.append(1)
        end = "raise SystemExit(1)" if text.endswith("EXIT") else "time.sleep(30)"
        code = f"import sys, time; print({text.removesuffix('EXIT')!r}, flush=True); {end}"
        return [P.start("supernode", [sys.executable, "-c", code], dict(os.environ), log_dir)]

    monkeypatch.setattr(DC, "start_client", fake_start)
    return starts


def _client_in_thread(tmp_path: Path, wait_s: float, limit_s: float) -> tuple[int | None, float]:
    """Runs ``deploy_client.client`` in a thread; (its exit code or None if still running after
    ``limit_s``, seconds it took)."""
    out: list[int] = []
    t0 = time.monotonic()
    thread = threading.Thread(
        target=lambda: out.append(DC.client("127.0.0.1:1", 0, 1, work_dir=tmp_path, wait_s=wait_s)),
        daemon=True,
    )
    thread.start()
    thread.join(limit_s)
    return (out[0] if out else None), time.monotonic() - t0


FLOWER_2004 = "(Flower: [code: 2004] Failed to activate SuperNode.)"
REFUSED = f"refused: node key not registered on the SuperLink {FLOWER_2004}"
NOT_YET = f"waiting for the server: node key not registered on the SuperLink yet {FLOWER_2004}"


def test_an_unregistered_key_gives_up_after_the_wait_with_exit_2(tmp_path, monkeypatch, capsys):
    """The wait is the one documented bound (--wait), not a back-off that overshoots it."""
    _fake_supernodes(monkeypatch, UNREGISTERED_LOG + "EXIT")
    monkeypatch.setattr(DC, "probe", lambda *a: None)  # the SuperLink answers
    code, took = _client_in_thread(tmp_path, 2.0, 30)
    assert code == 2 and took < 2.0 + 3, took
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"client 0: {NOT_YET}"
    gave_up = rf"client 0: gave up after 2\.\d s \(--wait 2\): {re.escape(REFUSED)}"
    assert re.fullmatch(gave_up, err[-1]), err
    assert len(err) == 2  # no line per restart


def test_a_server_that_stops_inside_the_wait_still_ends_it(tmp_path, monkeypatch, capsys):
    """Refused first, then nothing answers: the client still gives up when the wait is over
    (it used to switch to waiting forever)."""
    _fake_supernodes(monkeypatch, UNREGISTERED_LOG + "EXIT")
    answers = iter([None])
    monkeypatch.setattr(
        DC, "probe", lambda *a: next(answers, "nothing answers at 127.0.0.1:1 (Connection refused)")
    )
    code, took = _client_in_thread(tmp_path, 2.5, 30)
    assert code == 2 and took < 2.5 + 3, took
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("client 0: gave up after 2.") and err[-1].endswith(
        "(--wait 2.5): nothing answers at 127.0.0.1:1 (Connection refused)"
    )


def test_no_server_at_all_gives_up_after_the_wait(tmp_path, capsys):
    port = P.free_port()  # nothing listens there
    t0 = time.monotonic()
    code = DC.client(f"127.0.0.1:{port}", 0, 1, work_dir=tmp_path, wait_s=1.5)
    assert code == 2 and time.monotonic() - t0 < 1.5 + 3
    err = capsys.readouterr().err.splitlines()
    why = f"nothing answers at 127.0.0.1:{port} (Connection refused)"
    assert err == [
        f"client 0: waiting for the server ({why})",
        f"client 0: gave up after {err[-1].split()[5]} s (--wait 1.5): {why}",
    ]


SESSION_LOG = """\
\x1b[92mINFO \x1b[0m:      Starting Flower SuperNode
INFO:     Uvicorn running on http://127.0.0.1:42817 (Press CTRL+C to quit)
\x1b[92mINFO \x1b[0m:      SuperNode ID: 7373303653814358930
\x1b[92mINFO \x1b[0m:      [RUN 17, ROUND hello]
\x1b[92mINFO \x1b[0m:      Sending: query.fedfm_hello message (ID: 24)
\x1b[92mINFO \x1b[0m:      [RUN 17, ROUND 0]
\x1b[92mINFO \x1b[0m:      Receiving: query.fedfm message (ID: a2)
\x1b[92mINFO \x1b[0m:      [RUN 17, ROUND 0]
\x1b[92mINFO \x1b[0m:      Sending: query.fedfm message (ID: 43)
\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in 0.15 seconds
\x1b[92mINFO \x1b[0m:      [RUN 17, ROUND 1]
\x1b[92mINFO \x1b[0m:      Sending: query.fedfm message (ID: 8a)
\x1b[92mINFO \x1b[0m:      [RUN 17, ROUND 1]
\x1b[92mINFO \x1b[0m:      Sending: query.fedfm message (ID: 6f)
\x1b[93mWARNING \x1b[0m:   Connection attempt failed, retrying in 0.95 seconds
"""  # a session of two rounds (a passing failure, two exchanges in round 1), then the SuperLink
# stops (flwr 1.42)

HEARTBEAT_LOG = """\
\x1b[92mINFO \x1b[0m:      SuperNode ID: 53708869193791371
\x1b[92mINFO \x1b[0m:      [RUN 18, ROUND 1]
\x1b[92mINFO \x1b[0m:      Sending: query.fedfm message (ID: 1f)
Traceback (most recent call last):
    raise HTTPStatusError(message, request=request, response=self)
httpx.HTTPStatusError: Client error '401 Unauthorized' for url 'https://127.0.0.1:1/v1/fleet/send-node-heartbeat'
INFO:     Shutting down
"""  # the next session's SuperLink does not know the node: the heartbeat fails, it exits


def test_a_healthy_client_says_what_it_does_in_one_line_each(tmp_path, monkeypatch, capsys):
    """Waiting, connected, one line per round served, the end of each session; no
    traceback, no Flower or uvicorn log lines for the normal end of a session."""
    starts = _fake_supernodes(
        monkeypatch, UNREGISTERED_LOG + "EXIT", SESSION_LOG, HEARTBEAT_LOG + "EXIT", SESSION_LOG
    )
    down = "nothing answers at 127.0.0.1:1 (Connection refused)"
    # The probes: before each start, and at each failed connection attempt (answered: a
    # passing failure; not answered: the session ended).
    answers = iter([down, None, None, None, down, None, None, None, down])

    def probe(*a):
        found = next(answers, P.Stopped(signal.SIGTERM))
        if isinstance(found, P.Stopped):
            raise found
        return found

    monkeypatch.setattr(DC, "probe", probe)
    with pytest.raises(P.Stopped):
        DC.client("127.0.0.1:1", 0, 1, work_dir=tmp_path, wait_s=60)
    assert len(starts) == 4
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"client 0: waiting for the server ({down})",
        f"client 0: {NOT_YET}",  # a serve registers the keys a moment after it starts
        "client 0: connected",
        "client 0: served round 0",
        "client 0: served round 1",
        "client 0: server session ended; waiting for the next",
        "client 0: connected",
        "client 0: served round 1",
        "client 0: server session ended; waiting for the next",
        "client 0: connected",
        "client 0: served round 0",
        "client 0: served round 1",
        "client 0: server session ended; waiting for the next",
    ]


def test_a_supernode_that_fails_shows_its_log(tmp_path, monkeypatch, capsys):
    """A real failure (no refusal, never connected) is shown with the end of its log."""
    _fake_supernodes(monkeypatch, "Traceback (most recent call last):\nValueError: boomEXIT")
    monkeypatch.setattr(DC, "probe", lambda *a: None)
    code, _ = _client_in_thread(tmp_path, 1.0, 30)
    assert code == 2
    err = capsys.readouterr().err
    shown = "client 0: SuperNode exited (1):\nTraceback (most recent call last):\nValueError: boom"
    assert shown in err


def test_client_stop_line_names_the_state_folder_only_when_it_exists(tmp_path, monkeypatch):
    def stopped(*a, **kw):
        raise P.Stopped(signal.SIGTERM)

    monkeypatch.setattr(DC, "client", stopped)
    states = tmp_path / "states"
    args = ["client", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "1"]
    args += ["--insecure", "--state-dir", str(states)]
    res = runner.invoke(app, args)
    assert res.exit_code == 143
    line = res.output.strip().splitlines()[-1]
    assert line == (
        "client 0: stopped by SIGTERM (SuperNode and worker stopped); run the same command to"
        " rejoin"
    )
    (states / "run-uid" / "0").mkdir(parents=True)  # a snapshot folder, as ClientApps write
    res = runner.invoke(app, args)
    assert res.output.strip().endswith(f"to rejoin, its state snapshots stay in {states}")


def test_client_refuses_a_wait_that_is_not_positive(monkeypatch):
    monkeypatch.setattr(DC, "client", lambda *a, **kw: 0)
    args = ["client", "--superlink", "h:1", "--partition-id", "0", "--num-partitions", "1"]
    res = runner.invoke(app, [*args, "--insecure", "--wait", "0"])
    assert isinstance(res.exception, ConfigError) and str(res.exception).startswith(
        "config error: wait: must be more than 0 seconds"
    )
    assert runner.invoke(app, [*args, "--insecure", "--wait", "inf"]).exit_code == 0


def test_signals_become_stopped_with_the_shells_exit_codes():
    before = signal.getsignal(signal.SIGTERM)
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):
        with pytest.raises(P.Stopped) as info, P.stop_on_signals():
            os.kill(os.getpid(), sig)
            time.sleep(5)
        assert info.value.exit_code == code
    assert signal.getsignal(signal.SIGTERM) == before  # handlers restored


def test_stop_reaches_descendants_in_sessions_of_their_own(tmp_path):
    """As the SuperLink starts flower-superexec: a grandchild in a new session survives a
    signal to the child's process group; stop() ends it too."""
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " start_new_session=True)\n"
        f"open({str(tmp_path / 'pid')!r}, 'w').write(str(p.pid))\n"
        "time.sleep(60)\n"
    )
    proc = P.start("parent", [sys.executable, "-c", code], dict(os.environ), tmp_path)
    pid_file = tmp_path / "pid"
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    assert grandchild in P.descendants(proc.popen.pid)
    P.stop([proc], grace_s=2)
    time.sleep(0.2)
    assert not proc.alive() and not P._alive(grandchild)


# --------------------------------------------------------------------------- serve's progress


def _rows(folder: Path, rounds: range, tag: float) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"round": r, "rmse": tag + r, "time_s": 0.1, "bytes_up": 0, "bytes_down": 0}
            for r in rounds]  # fmt: skip
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_serve_shows_only_the_new_run_s_rounds(tmp_path, capsys):
    """With --overwrite the old run's rows stay until the new run moves the folder aside;
    they are never shown. Each round is shown once, then the final table."""
    from fedfm.config import load_config
    from fedfm.runtime.flower.watch import RunWatch

    cfg = load_config({"name": "dep", "rounds": 2, "out_dir": str(tmp_path), "algorithm": "fedavg"})
    run_dir = tmp_path / "dep"
    _rows(run_dir, range(3), 100.0)  # an old run
    watch = RunWatch(cfg, run_dir, resume=False, primary="rmse", poll_s=0.05)
    with watch:
        time.sleep(0.3)
        assert watch.shown == -1  # the old rows are not this run's
        run_dir.rename(tmp_path / ".dep.replaced")
        _rows(run_dir, range(2), 0.0)
        time.sleep(0.3)
        _rows(run_dir, range(3), 0.0)
    watch.final_table({"primary": "rmse"})
    err = capsys.readouterr().err
    assert "rmse=100" not in err and "rmse=101" not in err
    assert [line.split()[0] for line in err.splitlines() if "rmse=" in line] == ["0", "1", "2"]
    assert "rounds" in err  # the table
    # Resuming from the checkpoint of round 1 shows the rounds after it only, and the stop
    # line names that round.
    ck = run_dir / "checkpoints" / "round_00001"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(json.dumps({"round": 1}))
    (run_dir / "checkpoints" / "LATEST").write_text(ck.name)
    watch = RunWatch(cfg, run_dir, resume=True, primary="rmse", poll_s=0.05)
    with watch:
        pass
    err = capsys.readouterr().err
    assert [line.split()[0] for line in err.splitlines() if "rmse=" in line] == ["2"]
    assert watch.stop_line(signal.SIGTERM).startswith(
        "dep: stopped by SIGTERM at round 1 of 2: continue with the same `fedfm serve` command"
        " and --resume"
    )


def test_a_resumed_serve_says_the_round_it_resumes_from(tmp_path):
    from fedfm.config import load_config
    from fedfm.runtime.flower.watch import RunWatch

    cfg = load_config({"name": "dep", "rounds": 5, "out_dir": str(tmp_path)})
    run_dir = tmp_path / "dep"
    watch = RunWatch(cfg, run_dir, resume=True, primary="rmse")
    assert watch.resume_line() == "dep: no checkpoint to resume from: starting at round 0"
    ck = run_dir / "checkpoints" / "round_00003"
    ck.mkdir(parents=True)
    (ck / "meta.json").write_text(json.dumps({"round": 3}))
    (run_dir / "checkpoints" / "LATEST").write_text(ck.name)
    assert watch.resume_line() == f"dep: resuming from round 3 of 5 ({run_dir})"


def test_round_lines_in_a_log_file_are_neither_wrapped_nor_coloured(tmp_path):
    """Output that is not a terminal (a log file): one line per round whatever its length,
    and no colour codes, neither in the rounds nor in Flower's streamed log."""
    import io

    from rich.console import Console

    from fedfm.config import load_config
    from fedfm.progress import RoundDisplay

    buf = io.StringIO()  # not a terminal: rich's width is 80
    cfg = load_config({"name": "a-rather-long-run-name-for-a-long-line", "rounds": 2})
    display = RoundDisplay(cfg, primary="macro_f1", console=Console(file=buf))
    row = {"round": 1, "macro_f1": 0.61234, "loss": 1.2345678, "train_loss": 0.5432109,
           "clients": 10, "failed": 3, "bytes_up": 123456789, "bytes_down": 987654321,
           "time_s": 12.5}  # fmt: skip
    with display:
        display.update(row)
    lines = [x for x in buf.getvalue().splitlines() if x.strip()]
    assert len(lines) == 1 and len(lines[0]) > 80, lines
    assert "\x1b[" not in buf.getvalue()
    code = "print('\\x1b[92mINFO \\x1b[0m:      Starting logstream')"
    popen = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    out = io.StringIO()
    got: list[str] = []
    saved, sys.stdout = sys.stdout, out
    try:
        P._pump(popen, got, echo=True)
    finally:
        sys.stdout = saved
    popen.wait(10)
    assert out.getvalue() == "INFO :      Starting logstream\n"
    assert got[0].startswith("\x1b[92m")  # the kept log is Flower's own


def test_a_sessions_start_and_its_rounds_are_timed_apart(tmp_path):
    """``fedfm serve`` passes the time it started: ``start_s_this_session`` counts what came
    before the first round (SuperLink, ServerApp start, the wait for SuperNodes), and
    ``wall_s_this_session`` the rounds, as on the embedded runtime."""
    import fedfm.runtime.embedded as E
    from fedfm.config import load_config
    from fedfm.engine import Engine

    cfg = load_config({"name": "w", "rounds": 1, "out_dir": str(tmp_path), "plots": False})
    quick = Engine(cfg, E.embedded_federation, progress=False).run()
    assert quick["wall_s_this_session"] < 60
    cfg = cfg.model_copy(update={"name": "w2"})
    late = Engine(cfg, E.embedded_federation, progress=False, started_at=time.time() - 100)
    summary = late.run()
    assert 100 <= summary["start_s_this_session"] < 100 + 60
    assert summary["wall_s_this_session"] < 60  # from the first round, as on every runtime


def _cmdlines() -> list[list[str]]:
    """The command lines of the processes running now (from ``/proc``)."""
    out = []
    for p in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            out.append(p.read_bytes().decode(errors="replace").split("\0"))
    return out


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_serve_refuses_a_bad_algorithm_value_in_one_line_and_stops_its_early_superlink(tmp_path):
    """The algorithm's section is checked by the ServerApp process while the SuperLink
    starts: a refusal is still one line and exit 2, with no run folder, no temporary folder
    and no process left (the SuperLink and the `flwr run` CLI started ahead are stopped)."""
    port = str(P.free_port())
    (tmp_path / "tmp").mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "fedfm", "serve", "tabular-fedavg", "algo.nope=1", "--insecure",
         "--host", "127.0.0.1", "--port", port, f"out_dir={tmp_path / 'runs'}"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path / "tmp")},
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr == "error: config error: algo.nope: unknown key\n" and not out.stdout
    assert not (tmp_path / "runs").exists()
    assert not list((tmp_path / "tmp").glob("fedfm-*"))
    left = [c for c in _cmdlines() if port in c and ("--port" in c or any("flwr" in a for a in c))]
    assert not left, left


def test_the_documented_certificate_covers_the_name_serve_reaches_its_superlink_by(tmp_path):
    """docs/running-across-machines.md makes the certificate for server.example.org and
    10.0.0.5 only; serve registers keys and submits the run on this machine, so every
    certificate fedfm makes also covers 127.0.0.1 and localhost."""
    out = tmp_path / "certs"
    res = _certs(str(out), "--host", "server.example.org", "--host", "10.0.0.5", "--nodes", "1")
    assert res.exit_code == 0, res.output
    hosts = T.certificate_hosts(out / "server.pem")
    assert hosts == ["server.example.org", "10.0.0.5", "127.0.0.1", "localhost"]
    tls = T.tls_files(out)
    assert D.own_host("0.0.0.0", tls) == D.own_host("127.0.0.1", tls) == "127.0.0.1"
    assert D.own_host("10.0.0.5", tls) == "10.0.0.5"  # serve listens there: reached there
    assert D.own_host("0.0.0.0", None) == "127.0.0.1"
    assert T.covers(["*.example.org"], "server.example.org")
    assert not T.covers(["*.example.org"], "a.server.example.org")
    assert not T.covers(["10.0.0.5"], "server.example.org")


def test_serve_refuses_a_certificate_without_its_own_name_in_one_line(monkeypatch, tmp_path):
    """A certificate (e.g. from another CA) that covers only the public names: one line
    naming the host serve would reach its SuperLink by, exit code 2, nothing started (it
    used to fail in `flwr supernode register` with Flower's multi-line box, exit 1)."""
    certs = tmp_path / "certs"
    T.make_certificates(certs, ["server.example.org", "10.0.0.5"], loopback=False)
    assert T.certificate_hosts(certs / "server.pem") == ["server.example.org", "10.0.0.5"]
    started = []
    monkeypatch.setattr(D, "start_superlink", lambda *a, **kw: started.append(a))
    res = runner.invoke(app, ["serve", "tabular-fedavg", "--certificates", str(certs),
                              "--host", "0.0.0.0", f"out_dir={tmp_path / 'runs'}"])  # fmt: skip
    assert isinstance(res.exception, ConfigError) and not started
    assert str(res.exception).startswith(
        f"config error: certificates: the SuperLink's certificate {certs / 'server.pem'} is not"
        " valid for 127.0.0.1, where `fedfm serve` reaches its own SuperLink (it is valid for"
        " server.example.org, 10.0.0.5)"
    )
    assert "\n" not in str(res.exception) and not (tmp_path / "runs").exists()
    with pytest.raises(ConfigError, match="not valid for localhost"):
        D.own_host("localhost", T.tls_files(certs))


def test_serve_shows_fedfm_lines_of_the_stream_and_leaves_flowers_to_the_log(capsys):
    """What `flwr run --stream` printed in a healthy run (flwr 1.42) shows nothing; fedfm's
    warnings (bare lines) and Flower's warnings show."""
    healthy = [
        "Using SuperLink: fedfm (127.0.0.1:9092)\n",
        "Successfully started run 7366188045296898020\n",
        "\x1b[92mINFO \x1b[0m:      Starting logstream for run_id `7366188045296898020`\n",
        "INFO :      Start `flwr-serverapp` process\n",
        "Successfully installed fedfm-flower-app to /tmp/x/flwr-home/apps/fedfm.app.\n",
        "INFO :      \n",
        "\n",
    ]
    for line in healthy:
        D.show_warnings(line)
    assert capsys.readouterr() == ("", "")
    D.show_warnings("no SuperNode serves client(s) 2 after 30 s: they count as failed\n")
    D.show_warnings("\x1b[93mWARNING \x1b[0m:   Node Unavailable\n")
    assert capsys.readouterr().err.splitlines() == [
        "no SuperNode serves client(s) 2 after 30 s: they count as failed",
        "WARNING Node Unavailable",
    ]
