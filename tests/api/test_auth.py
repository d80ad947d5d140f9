"""Authentication: shared token (UNAUTHENTICATED without it or with a wrong one), TLS and mutual
TLS with certificates made here, between the services and for clients."""
import datetime
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness import ROOT, free_port, start, wait_healthy
from protos import generate_pb2, generate_pb2_grpc

TOKEN = "s3cret-token-for-tests"


def make_pki(d):
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject, pub, issuer, issuer_key, ca=False, san=None):
        b = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer)).public_key(pub)
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(path, obj):
        if hasattr(obj, "private_bytes"):
            data = obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption())
        else:
            data = obj.public_bytes(serialization.Encoding.PEM)
        (d / path).write_bytes(data)
        return str(d / path)

    ca_key = key()
    ca = cert("test-ca", ca_key.public_key(), "test-ca", ca_key, ca=True)
    srv_key, cli_key = key(), key()
    srv = cert("localhost", srv_key.public_key(), "test-ca", ca_key,
               san=[x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    cli = cert("gpu-service", cli_key.public_key(), "test-ca", ca_key)
    return {"ca": write("ca.pem", ca), "srv_cert": write("srv.pem", srv), "srv_key": write("srv.key", srv_key),
            "cli_cert": write("cli.pem", cli), "cli_key": write("cli.key", cli_key)}


def stub_call(port, metadata=(), creds=None, method="Info"):
    target = f"127.0.0.1:{port}"
    ch = grpc.secure_channel(target, creds, [("grpc.ssl_target_name_override", "localhost")]) if creds \
        else grpc.insecure_channel(target)
    with ch:
        stub = generate_pb2_grpc.GenerateServiceStub(ch)
        if method == "Info":
            return stub.Info(generate_pb2.ServerInfoRequest(), timeout=10, metadata=metadata)
        req = generate_pb2.GenerateRequest(prompt="hi", max_tokens=2, sampling=generate_pb2.SamplingParams(temperature=0))
        return list(stub.Generate(req, timeout=30, metadata=metadata))


@pytest.fixture(scope="module")
def secured(checkpoints, tmp_path_factory):
    """Expert service: token + mutual TLS. GPU service: token + TLS for its clients, client cert to the expert."""
    d = tmp_path_factory.mktemp("pki")
    pki = make_pki(d)
    (d / "token").write_text(TOKEN + "\n")
    model = str(checkpoints["mixtral"])
    eport, gport = free_port(), free_port()
    expert = start("expert_service", "--model", model, "--listen", f"127.0.0.1:{eport}", "--auth-token-file",
                   str(d / "token"), "--tls-cert", pki["srv_cert"], "--tls-key", pki["srv_key"], "--tls-client-ca",
                   pki["ca"], log=d / "e.log")
    gpu = start("gpu_service", "--model", model, "--experts", f"localhost:{eport}", "--listen", f"127.0.0.1:{gport}",
                "--tls-cert", pki["srv_cert"], "--tls-key", pki["srv_key"], "--experts-tls-ca", pki["ca"],
                "--experts-tls-client-cert", pki["cli_cert"], "--experts-tls-client-key", pki["cli_key"],
                log=d / "g.log", env={"MOE_AUTH_TOKEN": TOKEN})
    creds = grpc.ssl_channel_credentials(root_certificates=open(pki["ca"], "rb").read())
    try:
        health_ch = grpc.secure_channel(f"127.0.0.1:{gport}", creds, [("grpc.ssl_target_name_override", "localhost")])
        wait_healthy(gport, gpu, channel=health_ch)
    except Exception:
        expert.kill(), gpu.kill()
        raise RuntimeError((d / "e.log").read_text() + (d / "g.log").read_text())
    yield dict(pki=pki, eport=eport, gport=gport, creds=creds, dir=d)
    for p in (gpu, expert):
        p.terminate()
        p.wait(10)


GOOD = (("authorization", f"Bearer {TOKEN}"),)


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),),
                                      (("authorization", f"Bearer {TOKEN}x"),)])
@pytest.mark.parametrize("method", ["Info", "Generate"])
def test_bad_or_missing_token_is_unauthenticated(secured, metadata, method):
    with pytest.raises(grpc.RpcError) as e:
        stub_call(secured["gport"], metadata, secured["creds"], method)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_good_token_over_tls_works_and_health_is_open(secured):
    assert len(stub_call(secured["gport"], GOOD, secured["creds"], "Generate")) == 2
    with grpc.secure_channel(f"127.0.0.1:{secured['gport']}", secured["creds"],
                             [("grpc.ssl_target_name_override", "localhost")]) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_plaintext_client_cannot_talk_to_tls_server(secured):
    with pytest.raises(grpc.RpcError) as e:
        stub_call(secured["gport"], GOOD, None)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_expert_mtls_requires_a_client_certificate(secured):
    from protos import expert_pb2, expert_pb2_grpc
    pki = secured["pki"]
    ca = open(pki["ca"], "rb").read()
    opts = [("grpc.ssl_target_name_override", "localhost")]
    target = f"127.0.0.1:{secured['eport']}"
    with grpc.secure_channel(target, grpc.ssl_channel_credentials(ca), opts) as ch:  # no client cert
        with pytest.raises(grpc.RpcError) as e:
            expert_pb2_grpc.ExpertServiceStub(ch).Info(expert_pb2.ExpertInfoRequest(), timeout=5, metadata=GOOD)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    full = grpc.ssl_channel_credentials(ca, open(pki["cli_key"], "rb").read(), open(pki["cli_cert"], "rb").read())
    with grpc.secure_channel(target, full, opts) as ch:
        stub = expert_pb2_grpc.ExpertServiceStub(ch)
        assert stub.Info(expert_pb2.ExpertInfoRequest(), timeout=5, metadata=GOOD).n_routed_experts == 8
        with pytest.raises(grpc.RpcError) as e:
            stub.Info(expert_pb2.ExpertInfoRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_client_command_takes_the_same_options(secured):
    args = [sys.executable, "-m", "moe_client", "generate", "hi", "--server", f"127.0.0.1:{secured['gport']}",
            "--max-tokens", "2", "--tls-ca", secured["pki"]["ca"], "--tls-server-name", "localhost"]
    ok = subprocess.run(args + ["--auth-token-file", str(secured["dir"] / "token")], capture_output=True, text=True,
                        timeout=60, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={k: v for k, v in __import__("os").environ.items() if k != "MOE_AUTH_TOKEN"})
    assert bad.returncode == 1 and "UNAUTHENTICATED" in bad.stderr


def test_gpu_service_without_the_token_refuses_to_start(secured, checkpoints, tmp_path):
    pki = secured["pki"]
    p = subprocess.run([sys.executable, "-m", "gpu_service", "--model", str(checkpoints["mixtral"]), "--experts",
                        f"localhost:{secured['eport']}", "--listen", f"127.0.0.1:{free_port()}", "--experts-tls-ca",
                        pki["ca"], "--experts-tls-client-cert", pki["cli_cert"], "--experts-tls-client-key",
                        pki["cli_key"], "--connect-timeout", "10"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 2 and "refused" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_non_loopback_without_auth_warns(checkpoints, tmp_path):
    port = free_port()
    p = start("expert_service", "--model", str(checkpoints["mixtral"]), "--listen", f"0.0.0.0:{port}",
              log=tmp_path / "e.log")
    try:
        wait_healthy(port, p)
        assert "WITHOUT authentication" in (tmp_path / "e.log").read_text()
    finally:
        p.kill()
        p.wait()


# -- tenants: each client's token names its tenant; the prefix cache is per tenant and per cache_salt ---------------
SYSTEM = [{"role": "system", "content": "You write short Python functions. " * 4},
          {"role": "user", "content": "Sort a dict by value"}]


def tenants_services(tmp_path, *extra):
    from harness import Services

    (tmp_path / "tenants").write_text("# name token\nalice alice-token\nbob bob-token  # the second tenant\n")
    http = free_port()
    s = Services(ROOT / "models" / "default", tmp_path, gpu_args=(
        "--http-listen", f"127.0.0.1:{http}", "--served-model-name", "default",
        "--tenants-file", str(tmp_path / "tenants"), *extra))
    return s, http


def cached(http: int, key: str, salt: str | None = None, header: str = "bearer") -> int:
    import openai

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key=key if header == "bearer" else "unused",
                      max_retries=0, default_headers={} if header == "bearer" else {"x-api-key": key,
                                                                                    "Authorization": ""})
    r = c.chat.completions.create(model="default", messages=SYSTEM, max_tokens=2, temperature=0,
                                  extra_body={} if salt is None else {"cache_salt": salt})
    return r.usage.prompt_tokens_details.cached_tokens


def grpc_cached(s, key: str, salt: str = "") -> int:
    req = generate_pb2.GenerateRequest(
        chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(**m) for m in SYSTEM]), max_tokens=2,
        sampling=generate_pb2.SamplingParams(temperature=0), cache_salt=salt)
    return list(s.stub.Generate(req, timeout=60, metadata=(("authorization", f"Bearer {key}"),)))[-1].usage.cached_tokens


def test_tenants_never_share_cached_prefixes_and_salts_separate_requests(tmp_path):
    """A second client sending another's prompt must not learn it from a cache hit (the cached share and the first
    token's time): tenants get separate namespaces of the prefix cache by default, and within one, requests share
    blocks only with the same cache_salt (HTTP and gRPC alike); x-api-key names a tenant as a bearer token does."""
    import openai

    s, http = tenants_services(tmp_path)
    try:
        assert cached(http, "alice-token") == 0
        hit = cached(http, "alice-token")
        assert hit > 0  # the tenant's own second request hits
        assert cached(http, "bob-token") == 0  # another tenant's does not
        assert cached(http, "bob-token", header="x-api-key") == hit  # (its second does, by either header)
        assert cached(http, "alice-token", salt="s1") == 0  # a salt is a namespace of its own
        assert cached(http, "alice-token", salt="s1") == hit
        assert cached(http, "alice-token", salt="s2") == 0
        assert grpc_cached(s, "alice-token") == hit and grpc_cached(s, "bob-token", "s1") == 0
        with pytest.raises(openai.AuthenticationError):
            cached(http, "carol-token")
        with pytest.raises(grpc.RpcError) as e:
            grpc_cached(s, "carol-token")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(openai.BadRequestError) as e:
            cached(http, "alice-token", salt="x" * 2000)
        assert e.value.body["param"] == "cache_salt"
    finally:
        s.stop()


@pytest.mark.slow
def test_a_global_prefix_cache_scope_shares_blocks_between_tenants(tmp_path):
    s, http = tenants_services(tmp_path, "--prefix-cache-scope", "global")
    try:
        assert cached(http, "alice-token") == 0
        assert cached(http, "bob-token") > 0
        assert cached(http, "bob-token", salt="s") == 0  # salts still separate
    finally:
        s.stop()


def test_a_malformed_tenants_file_is_refused_at_start(tmp_path):
    (tmp_path / "tenants").write_text("alice alice-token\nbob\n")
    from harness import refused_at_start

    err = refused_at_start("gpu_service", "--model", str(ROOT / "models" / "default"), "--experts", "127.0.0.1:1",
                           "--tenants-file", str(tmp_path / "tenants"))
    assert "tenants:2: expected 'NAME TOKEN'" in err and "Traceback" not in err, err[-1500:]
