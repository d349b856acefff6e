"""Fixtures shared by every suite: checkpoints, users with roles, API clients."""

from __future__ import annotations

import email
import html
import os
import re
import socket
from email import policy
from pathlib import Path

import pytest
import torch

from tests.checkpoints import CHAT_TEMPLATE, save_random_model, tiny_config, train_tokenizer

torch.set_num_threads(2)

# Alerts notify at once in tests (the default route's group_wait is 30 s); tests of grouping set
# their own routes. The environment variable reaches the workers tests start.
os.environ["INFEROPS_ALERT_GROUP_WAIT_S"] = "0"


def pytest_runtest_setup(item):
    """Tests marked `vllm` need vLLM (`make vllm`): skipped, saying so, where it is missing, unless
    INFEROPS_TEST_REQUIRE_VLLM=1 (.ci/run sets it), where a missing vLLM fails the test instead."""
    if item.get_closest_marker("vllm") is None:
        return
    from deployments.replicas.drivers.local import vllm_missing

    missing = vllm_missing()
    if missing and os.environ.get("INFEROPS_TEST_REQUIRE_VLLM") == "1":
        pytest.fail(f"vLLM is required here (INFEROPS_TEST_REQUIRE_VLLM=1) and missing: {missing}", pytrace=False)
    if missing:
        pytest.skip(missing)


@pytest.fixture(autouse=True)
def _alerts_notify_at_once(settings):
    settings.INFEROPS_ALERT_GROUP_WAIT_S = 0


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory):
    """Build (once per name) a tiny checkpoint with tokenizer files; returns its directory."""
    built: dict[str, Path] = {}

    def build(name: str, kind: str = "llama", seed: int = 0, dtype=torch.float32, **overrides) -> Path:
        if name not in built:
            directory = tmp_path_factory.mktemp(name)
            vocab = train_tokenizer(directory, chat_template=CHAT_TEMPLATE)
            assert vocab <= overrides.get("vocab_size", 320)
            save_random_model(tiny_config(kind, **overrides), directory, seed=seed, dtype=dtype)
            built[name] = directory
        return built[name]

    return build


@pytest.fixture(scope="session")
def tiny_llama_dir(checkpoint_factory) -> Path:
    """A tiny fp32 Llama checkpoint (2 layers, hidden 64, 4 heads / 2 KV heads) with a chat template."""
    return checkpoint_factory("tiny-llama", "llama")


@pytest.fixture
def make_user(db):
    from django.contrib.auth.models import Group, User

    def make(role: str | None, username: str | None = None) -> User:
        name = username or f"{role or 'nobody'}-user"
        user = User.objects.create_user(username=name, password="pw-12345678")
        if role:
            user.groups.add(Group.objects.get(name=role))
        return user

    return make


@pytest.fixture
def worker_env(tmp_path, settings):
    """The environment of a worker process a test starts (tests/services.start_worker): the test database,
    this test's data directory, and short reconcile, scrape and heartbeat intervals."""
    from tests.services import database_url

    settings.INFEROPS_DATA_DIR = tmp_path
    env = {**os.environ,
           "DATABASE_URL": database_url(),
           "INFEROPS_DATA_DIR": str(tmp_path), "INFEROPS_RECONCILE_INTERVAL_S": "1",
           "INFEROPS_SCRAPE_INTERVAL_S": "2", "INFEROPS_HEARTBEAT_S": "5"}
    return env


class SmtpSink:
    """aiosmtpd handler: keeps each message; RCPT answers from a script (then accepts)."""

    def __init__(self):
        self.messages: list[tuple[list[str], email.message.EmailMessage]] = []
        self.rcpt_replies: list[str] = []

    async def handle_RCPT(self, server, session, envelope, address, rcpt_options):  # noqa: N802 (aiosmtpd's name)
        if self.rcpt_replies:
            return self.rcpt_replies.pop(0)
        envelope.rcpt_tos.append(address)
        return "250 OK"

    async def handle_DATA(self, server, session, envelope):  # noqa: N802
        message = email.message_from_bytes(envelope.content, policy=policy.default)
        self.messages.append((list(envelope.rcpt_tos), message))
        return "250 Message accepted for delivery"


@pytest.fixture
def smtp_server():
    """A real SMTP server on a free port (for the e-mail receiver: alerts, on-call); yields (handler, port)."""
    from aiosmtpd.controller import Controller

    sink = SmtpSink()
    controller = Controller(sink, hostname="127.0.0.1", port=free_port())
    controller.start()
    yield sink, controller.port
    controller.stop()


@pytest.fixture
def smtp(settings, smtp_server):
    """Django's SMTP backend pointed at the test's server (pytest-django swaps in locmem otherwise)."""
    settings.EMAIL_BACKEND = "django.core.mail.backends.smtp.EmailBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", smtp_server[1]
    settings.EMAIL_TIMEOUT = 5
    settings.DEFAULT_FROM_EMAIL = "inferops@example.com"
    return smtp_server[0]


@pytest.fixture
def api(make_user):
    """`api(role)` -> a DRF test client authenticated with that role's token."""
    from rest_framework.authtoken.models import Token
    from rest_framework.test import APIClient

    users: dict[str, object] = {}

    def client_for(role: str | None) -> APIClient:
        client = APIClient()
        if role is not None:
            if role not in users:
                users[role] = make_user(role, username=f"{role}-api")
            token, _ = Token.objects.get_or_create(user=users[role])
            client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
        return client

    return client_for


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def text_of(response) -> str:
    """A console page's text as a reader sees it: white space folded, entities decoded."""
    return html.unescape(re.sub(r"\s+", " ", response.content.decode()))
