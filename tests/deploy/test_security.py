"""TLS, mutual TLS and API keys on real gRPC servers on loopback, with certificates made here."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import grpc
import pytest
from batchwire.common.tls import ClientTls, ServerTls, add_port, channel
from batchwire.v1 import generate_pb2, generate_pb2_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

from scheduler_svc.service.security import ApiKeyInterceptor, ApiKeys, bearer_token

from .certs import make_ca, make_cert

GENERATION = "batchwire.v1.Generation"
TIMEOUT = 10.0


class EchoGeneration(generate_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        yield generate_pb2.GenerateResponse(request_id=request.request_id, text="ok")

    async def Tokenize(self, request, context):
        return generate_pb2.TokenizeResponse(token_ids=[1, 2, 3])


class LoopbackServer:
    """A grpc.aio server on 127.0.0.1 in a thread of its own: Generation, health, reflection."""

    def __init__(self, tls: ServerTls | None = None, interceptors=()) -> None:
        self.tls, self.interceptors = tls, list(interceptors)
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(TIMEOUT), "test server did not start"
        assert self.port, "test server could not bind"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        started.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.server = grpc.aio.server(interceptors=self.interceptors)
        generate_pb2_grpc.add_GenerationServicer_to_server(EchoGeneration(), self.server)
        health = HealthServicer()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(health, self.server)
        reflection.enable_server_reflection(
            (GENERATION, "grpc.health.v1.Health", reflection.SERVICE_NAME), self.server)
        self.port = add_port(self.server, "127.0.0.1:0", self.tls)
        await self.server.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT)


@pytest.fixture
def serve():
    servers: list[LoopbackServer] = []

    def start(tls: ServerTls | None = None, interceptors=()) -> LoopbackServer:
        servers.append(LoopbackServer(tls, interceptors))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """Files of a CA, a server certificate, a client certificate, and an impostor's pair."""
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = make_ca(), make_ca("another CA")
    files = {"ca": str(d / "ca.crt"), "other_ca": str(d / "other-ca.crt")}
    (d / "ca.crt").write_bytes(ca.cert)
    (d / "other-ca.crt").write_bytes(other_ca.cert)
    files["server"] = make_cert(ca, "scheduler", ("localhost", "127.0.0.1")).write(d, "server")
    files["worker"] = make_cert(ca, "worker", ("batchwire-worker",)).write(d, "worker")
    files["client"] = make_cert(ca, "scheduler", client=True, server=False).write(d, "client")
    files["impostor"] = make_cert(other_ca, "scheduler", client=True, server=False).write(
        d, "impostor")
    files["dir"] = d
    return files


def generate(address: str, tls: ClientTls | None = None, key: str | None = None) -> str:
    """One Generate call; its text, or raises grpc.RpcError."""
    with channel(address, tls) as ch:
        metadata = [("authorization", f"Bearer {key}")] if key is not None else None
        stub = generate_pb2_grpc.GenerationStub(ch)
        replies = stub.Generate(generate_pb2.GenerateRequest(request_id="r", text="hi"),
                                timeout=TIMEOUT, metadata=metadata)
        return "".join(r.text for r in replies)


def refused(fn, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kwargs)
    return e.value.code()


# -- TLS for the client API -------------------------------------------------------------------


def test_tls_client_api(serve, pki):
    server = serve(ServerTls.from_options(*pki["server"]))
    assert generate(server.address, ClientTls.from_options(pki["ca"])) == "ok"
    assert generate(f"localhost:{server.port}", ClientTls.from_options(pki["ca"])) == "ok"
    # A plaintext client, and one that trusts another CA, do not get through the handshake.
    assert refused(generate, server.address) == grpc.StatusCode.UNAVAILABLE
    assert refused(generate, server.address,
                   ClientTls.from_options(pki["other_ca"])) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_between_scheduler_and_worker(serve, pki):
    worker = serve(ServerTls.from_options(*pki["worker"], client_ca=pki["ca"]))
    scheduler = ClientTls.from_options(pki["ca"], *pki["client"], server_name="batchwire-worker")
    assert generate(worker.address, scheduler) == "ok"
    # No client certificate; a certificate from another CA; the wrong name expected.
    anonymous = ClientTls.from_options(pki["ca"], server_name="batchwire-worker")
    impostor = ClientTls.from_options(pki["ca"], *pki["impostor"], server_name="batchwire-worker")
    wrong_name = ClientTls.from_options(pki["ca"], *pki["client"], server_name="someone-else")
    for tls in (anonymous, impostor, wrong_name, None):
        assert refused(generate, worker.address, tls) == grpc.StatusCode.UNAVAILABLE


def test_server_certificate_rotates_without_restart(serve, pki, tmp_path):
    old_ca, new_ca = make_ca("old"), make_ca("new")
    cert, key = make_cert(old_ca, "s", ("127.0.0.1",)).write(tmp_path, "tls")
    (tmp_path / "old.crt").write_bytes(old_ca.cert)
    (tmp_path / "new.crt").write_bytes(new_ca.cert)
    server = serve(ServerTls.from_options(cert, key))
    trusts_old = ClientTls.from_options(str(tmp_path / "old.crt"))
    trusts_new = ClientTls.from_options(str(tmp_path / "new.crt"))
    assert generate(server.address, trusts_old) == "ok"
    rotated = make_cert(new_ca, "s", ("127.0.0.1",))
    (tmp_path / "tls.key").write_bytes(rotated.key)
    (tmp_path / "tls.crt").write_bytes(rotated.cert)
    later = time.time() + 5  # a new modification time even on a coarse clock
    os.utime(tmp_path / "tls.crt", (later, later))
    assert generate(server.address, trusts_new) == "ok"
    assert refused(generate, server.address, trusts_old) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("options, message", [
    (dict(cert="a.crt"), "go together"),
    (dict(client_ca="ca.crt"), "needs"),
    (dict(cert="missing.crt", key="missing.key"), "cannot read"),
])
def test_tls_options_are_checked_at_start_up(monkeypatch, tmp_path, options, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        ServerTls.from_options(options.get("cert"), options.get("key"), options.get("client_ca"))


def test_a_file_that_is_not_pem_is_refused(tmp_path):
    (tmp_path / "x.crt").write_text("not a certificate")
    (tmp_path / "x.key").write_text("not a key")
    with pytest.raises(ValueError, match="not PEM"):
        ServerTls.from_options(str(tmp_path / "x.crt"), str(tmp_path / "x.key"))


# -- API keys -----------------------------------------------------------------------------------


def test_api_key_required_on_generation_but_not_on_health_or_reflection(serve, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# one key a line\nkey-one\n\nkey-two\n")
    server = serve(interceptors=[ApiKeyInterceptor(ApiKeys.from_file(str(key_file)))])
    assert generate(server.address, key="key-one") == "ok"
    assert generate(server.address, key="key-two") == "ok"
    for key in (None, "", "key-on", "key-one2", "KEY-ONE"):
        assert refused(generate, server.address, key=key) == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(server.address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        with pytest.raises(grpc.RpcError) as e:  # a unary method is guarded too
            stub.Tokenize(generate_pb2.TokenizeRequest(text="x"), timeout=TIMEOUT)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer" in e.value.details()
        assert stub.Tokenize(generate_pb2.TokenizeRequest(text="x"), timeout=TIMEOUT,
                             metadata=[("authorization", "bearer key-two")]).token_ids == [1, 2, 3]
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=TIMEOUT)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        listing = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT)
        names = {s.name for r in listing for s in r.list_services_response.service}
        assert GENERATION in names


def test_api_key_file_is_read_again_when_it_changes(serve, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("old\n")
    server = serve(interceptors=[ApiKeyInterceptor(ApiKeys.from_file(str(key_file)))])
    assert generate(server.address, key="old") == "ok"
    key_file.write_text("new\n")
    os.utime(key_file, (time.time() + 5, time.time() + 5))
    assert generate(server.address, key="new") == "ok"
    assert refused(generate, server.address, key="old") == grpc.StatusCode.UNAUTHENTICATED


def test_api_key_over_tls(serve, pki, tmp_path):
    (tmp_path / "keys").write_text("secret\n")
    server = serve(ServerTls.from_options(*pki["server"]),
                   [ApiKeyInterceptor(ApiKeys.from_file(str(tmp_path / "keys")))])
    tls = ClientTls.from_options(pki["ca"])
    assert generate(server.address, tls, key="secret") == "ok"
    assert refused(generate, server.address, tls, key="guess") == grpc.StatusCode.UNAUTHENTICATED


def test_bearer_token_parsing():
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("x-other", "1"), ("authorization", "bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic abc")]) is None
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token([]) is None and bearer_token(None) is None


def test_an_empty_key_file_is_refused_at_start_up(tmp_path):
    (tmp_path / "keys").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="no API key"):
        ApiKeys.from_file(str(tmp_path / "keys"))


def test_cli_generate_over_tls_with_an_api_key(serve, pki, tmp_path, capsys, monkeypatch):
    from scheduler_svc import cli

    (tmp_path / "keys").write_text("secret\n")
    server = serve(ServerTls.from_options(*pki["server"]),
                   [ApiKeyInterceptor(ApiKeys.from_file(str(tmp_path / "keys")))])
    # --raw: the echo server has no GetModelInfo, which generate asks for the chat template.
    address = ["--address", f"localhost:{server.port}", "--tls-ca", pki["ca"], "--raw"]
    assert cli.main(["generate", *address, "--api-key-file", str(tmp_path / "keys"),
                     "--quiet", "hi"]) == 0
    assert capsys.readouterr().out.strip() == "ok"
    monkeypatch.setenv("BATCHWIRE_API_KEY", "wrong")
    assert cli.main(["generate", *address, "hi"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
