"""Production settings (issue 40): `manage.py check --deploy` passes with the environment
docs/operations.md documents, HTTPS is enforced behind a TLS proxy, sign-ins are rate limited
per account and per address, and every page carries a Content-Security-Policy whose nonce its
inline scripts carry (the browser half: tests/browser/test_content_security_policy.py)."""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.test import Client

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE_DIRS = [ROOT / "templates", *ROOT.glob("*/templates")]


def documented_production_env() -> dict[str, str]:
    """The block under <!-- production-env --> in docs/operations.md, with a fresh SECRET_KEY."""
    text = (ROOT / "docs" / "operations.md").read_text()
    block = re.search(r"<!-- production-env -->\n```sh\n(.*?)```", text, re.S).group(1)
    env = dict(line.split("=", 1) for line in block.splitlines() if line.strip())
    assert env["SECRET_KEY"].startswith("<"), "the documented block shows where the key goes, not a key"
    env["SECRET_KEY"] = secrets.token_urlsafe(50)
    return env


def check_deploy(extra_env: dict[str, str]) -> subprocess.CompletedProcess:
    # Nothing of the test run's own: its SECRET_KEY, and the browser suite's DJANGO_ALLOW_ASYNC_UNSAFE
    # (tests/browser/conftest.py), which check --deploy rightly refuses.
    env = {key: value for key, value in os.environ.items()
           if key not in ("SECRET_KEY", "DJANGO_ALLOW_ASYNC_UNSAFE")} | extra_env
    return subprocess.run([sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_check_deploy_passes_with_the_documented_production_environment():
    result = check_deploy(documented_production_env())
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_deploy_fails_without_it():
    result = check_deploy({"SECRET_KEY": secrets.token_urlsafe(50)})
    assert result.returncode != 0
    for warning in ("security.W004", "security.W008", "security.W012", "security.W016"):
        assert warning in result.stderr + result.stdout


@pytest.mark.parametrize("key", [None, "short-key"])
def test_production_refuses_to_start_without_a_real_secret_key(key):
    env = documented_production_env()
    del env["SECRET_KEY"]
    if key:
        env["SECRET_KEY"] = key
    result = check_deploy(env)
    assert result.returncode != 0
    assert "INFEROPS_PRODUCTION=1 needs SECRET_KEY" in result.stderr


@pytest.fixture
def production(settings):
    """The settings INFEROPS_PRODUCTION=1 and the documented environment give, in this process."""
    settings.SESSION_COOKIE_SECURE = settings.CSRF_COOKIE_SECURE = settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_HSTS_SECONDS, settings.SECURE_HSTS_INCLUDE_SUBDOMAINS = 365 * 86400, True
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    settings.ALLOWED_HOSTS = ["inferops.example.com"]
    return settings


@pytest.mark.django_db
def test_plain_http_is_redirected_but_probes_and_metrics_are_not(production):
    client = Client(HTTP_HOST="inferops.example.com")
    page = client.get("/login/")
    assert page.status_code == 301 and page["Location"] == "https://inferops.example.com/login/"
    assert client.get("/healthz").status_code in (200, 503)
    assert client.get("/metrics").status_code != 301
    # The gateway forwards /v1/files and /v1/batches to the web app over the cluster's plain HTTP.
    assert client.get("/v1/batches").status_code == 401


@pytest.mark.django_db
def test_behind_the_tls_proxy_pages_carry_hsts_and_secure_cookies(production):
    client = Client(HTTP_HOST="inferops.example.com", HTTP_X_FORWARDED_PROTO="https")
    page = client.get("/login/")
    assert page.status_code == 200
    assert page["Strict-Transport-Security"] == "max-age=31536000; includeSubDomains"
    assert page.cookies["csrftoken"]["secure"]
    User.objects.create_user("prod-admin", password="pw-prod-12345678")
    signed_in = client.post("/login/", {"username": "prod-admin", "password": "pw-prod-12345678"})
    assert signed_in.status_code == 302 and signed_in.cookies["sessionid"]["secure"]


# -- login rate limiting ---------------------------------------------------------------------------

def fresh_address() -> str:
    """An address no other test (or earlier run) used: counts live in Redis across runs."""
    return f"10.{secrets.randbelow(256)}.{secrets.randbelow(256)}.{secrets.randbelow(254) + 1}"


def fresh_user() -> tuple[str, str]:
    name, password = f"limited-{uuid.uuid4().hex[:10]}", "pw-right-12345678"
    User.objects.create_user(name, password=password)
    return name, password


def sign_in(client: Client, name: str, password: str, path: str = "/login/"):
    return client.post(path, {"username": name, "password": password})


@pytest.mark.django_db
def test_an_account_is_locked_after_five_wrong_passwords_even_for_the_right_one(settings):
    name, password = fresh_user()
    client = Client(REMOTE_ADDR=fresh_address())
    for _ in range(settings.INFEROPS_LOGIN_MAX_FAILURES_PER_ACCOUNT):
        assert sign_in(client, name, "wrong-password").status_code == 200  # the form again, with its error
    refused = sign_in(client, name, password)
    assert refused.status_code == 429
    assert 0 < int(refused["Retry-After"]) <= settings.INFEROPS_LOGIN_LOCKOUT_S
    assert "Too many failed sign-ins from this account: try again in 15 minutes" in refused.content.decode()
    # From another address too: the account is what is locked.
    assert sign_in(Client(REMOTE_ADDR=fresh_address()), name, password).status_code == 429
    # Another account from the first address still signs in.
    other, other_password = fresh_user()
    assert sign_in(client, other, other_password).status_code == 302


@pytest.mark.django_db
def test_a_success_forgets_the_accounts_failures(settings):
    name, password = fresh_user()
    client = Client(REMOTE_ADDR=fresh_address())
    for _ in range(settings.INFEROPS_LOGIN_MAX_FAILURES_PER_ACCOUNT - 1):
        sign_in(client, name, "wrong-password")
    assert sign_in(client, name, password).status_code == 302
    client.logout()
    for _ in range(settings.INFEROPS_LOGIN_MAX_FAILURES_PER_ACCOUNT - 1):
        sign_in(client, name, "wrong-password")
    assert sign_in(client, name, password).status_code == 302


@pytest.mark.django_db
def test_an_address_guessing_many_accounts_is_refused(settings):
    settings.INFEROPS_LOGIN_MAX_FAILURES_PER_ADDRESS = 4
    client = Client(REMOTE_ADDR=fresh_address())
    for _ in range(4):
        sign_in(client, f"nobody-{uuid.uuid4().hex[:8]}", "guess")
    name, password = fresh_user()
    refused = sign_in(client, name, password)
    assert refused.status_code == 429 and "from this address" in refused.content.decode()
    assert sign_in(Client(REMOTE_ADDR=fresh_address()), name, password).status_code == 302


@pytest.mark.django_db
def test_behind_trusted_proxies_the_address_is_the_one_the_outermost_proxy_saw(settings):
    settings.INFEROPS_LOGIN_MAX_FAILURES_PER_ADDRESS = 2
    settings.INFEROPS_TRUSTED_PROXIES = 1
    attacker, bystander = fresh_address(), fresh_address()
    proxy = Client(REMOTE_ADDR="192.0.2.1")
    for _ in range(2):
        # What the attacker writes into the header (left) is not trusted; what the proxy appends is.
        proxy.post("/login/", {"username": "x", "password": "y"}, HTTP_X_FORWARDED_FOR=f"{bystander}, {attacker}")
    name, password = fresh_user()
    assert proxy.post("/login/", {"username": name, "password": password},
                      HTTP_X_FORWARDED_FOR=attacker).status_code == 429
    assert proxy.post("/login/", {"username": name, "password": password},
                      HTTP_X_FORWARDED_FOR=bystander).status_code == 302


@pytest.mark.django_db
def test_the_django_admin_login_is_limited_with_the_same_counts(settings):
    name, password = fresh_user()
    User.objects.filter(username=name).update(is_staff=True, is_superuser=True)
    client = Client(REMOTE_ADDR=fresh_address())
    for _ in range(settings.INFEROPS_LOGIN_MAX_FAILURES_PER_ACCOUNT):
        sign_in(client, name, "wrong-password", "/admin/login/")
    refused = sign_in(client, name, password, "/admin/login/")
    assert "Too many failed sign-ins from this account" in refused.content.decode()
    assert "_auth_user_id" not in client.session
    assert sign_in(Client(REMOTE_ADDR=fresh_address()), name, password).status_code == 429


@pytest.mark.django_db
def test_without_redis_sign_in_still_works_unlimited(settings, caplog):
    settings.CACHES = {"default": {"BACKEND": "django.core.cache.backends.redis.RedisCache",
                                   "LOCATION": "redis://127.0.0.1:1/0"}}  # nothing listens there
    name, password = fresh_user()
    client = Client(REMOTE_ADDR=fresh_address())
    assert sign_in(client, name, "wrong-password").status_code == 200
    assert sign_in(client, name, password).status_code == 302
    assert "login rate limiting is off" in caplog.text


# -- Content-Security-Policy -----------------------------------------------------------------------

@pytest.mark.django_db
def test_every_answer_has_a_csp_and_inline_scripts_carry_its_nonce(make_user):
    client = Client()
    client.force_login(make_user("admin"))
    page = client.get("/")
    policy = page["Content-Security-Policy"]
    nonce = re.search(r"'nonce-([^']+)'", policy).group(1)
    assert "object-src 'none'" in policy and "frame-ancestors 'none'" in policy and "'unsafe-eval'" not in policy
    scripts = re.findall(r"<script([^>]*)>", page.content.decode())
    assert scripts and all(f'nonce="{nonce}"' in attrs or "src=" in attrs for attrs in scripts)
    assert client.get("/").headers["Content-Security-Policy"] != policy  # a nonce per answer
    assert "Content-Security-Policy" in client.get("/api/v1/models/").headers


def test_no_template_has_an_inline_event_handler_or_a_script_without_the_nonce():
    """The policy refuses inline handlers (onclick=...) and scripts without the nonce."""
    offenders = []
    for directory in TEMPLATE_DIRS:
        for path in directory.rglob("*.html"):
            text = path.read_text()
            offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in re.finditer(r"\son[a-z]+=\"", text)]
            bare_scripts = re.finditer(r"<script(?![^>]*(src=|nonce=))[^>]*>", text)
            offenders += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in bare_scripts]
    assert offenders == []
