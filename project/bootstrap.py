"""First-run set-up: the admin user (and, as later issues land, the demo resources)."""

from __future__ import annotations

import os
import secrets
from decimal import Decimal
from pathlib import Path

from django.contrib.auth import get_user_model
from django.contrib.auth.models import Group
from django.db import transaction

from inferops.roles import ADMIN


def ensure_admin(username: str = "admin") -> str | None:
    """Create the first admin when no admin exists; return its password (shown once) or None."""
    User = get_user_model()
    with transaction.atomic():
        if User.objects.filter(is_superuser=True).exists():
            return None
        password = secrets.token_urlsafe(12)
        user = User.objects.create_superuser(username=username, email="", password=password)
        user.groups.add(Group.objects.get(name=ADMIN))
    return password


PASSWORD_FILE = "admin-password"


def save_admin_password(data_dir: Path, password: str, username: str = "admin") -> Path:
    """Write the first admin's password to `<data dir>/admin-password`, readable by its owner only:
    printed once, it would scroll away under the workers' logs."""
    path = data_dir / PASSWORD_FILE
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # a file left from an earlier database keeps its old mode otherwise
    with os.fdopen(descriptor, "w") as handle:
        handle.write(f"# the first admin, created by `inferops run`; delete this file once you changed it\n"
                     f"username: {username}\npassword: {password}\n")
    return path


DEMO_NAME = "demo"


def ensure_demo(data_dir: Path, actor=None) -> bool:
    """Once per database: a demo checkpoint, registered as model `demo` and deployed as `demo`.

    Returns True when it created anything. Deleting the deployment is respected: it is only
    created together with the model, never re-created behind an operator's back.
    """
    from deployments.services import deployment_create
    from registry.models import RegisteredModel
    from registry.services import alias_set, model_create, version_register
    from runtime.engine.demo_model import write_demo_model

    if RegisteredModel.objects.filter(name=DEMO_NAME).exists():
        return False
    checkpoint = data_dir / "models" / "demo-tiny"
    if not (checkpoint / "model.safetensors").is_file():
        write_demo_model(checkpoint, preset="tiny", seed=0)
    actor = actor or get_user_model().objects.filter(is_superuser=True).order_by("pk").first()
    model = model_create(name=DEMO_NAME, task="generate", actor=actor, owner="inferops",
                         description="Demo Llama checkpoint (random weights) written by `make run`.",
                         tags=["demo"])
    version = version_register(model=model, artifact_uri=str(checkpoint), actor=actor)
    alias_set(model=model, name="champion", version=version, actor=actor)
    deployment_create(name=DEMO_NAME, model=model, alias="champion", replicas=1, actor=actor,
                      engine_args={"max_num_seqs": 32})
    ensure_demo_prices(actor)
    return True


def ensure_demo_prices(actor=None) -> bool:
    """A price for what the demo replica holds (CPU cores; it is a local replica without explicit
    resources), from the start of this hour, so the cost page shows numbers within minutes.
    Nothing when the price book has a cpu price already."""
    from django.utils import timezone

    from costing.models import Price
    from costing.services import price_create

    if Price.objects.filter(resource="cpu").exists():
        return False
    start = timezone.now().replace(minute=0, second=0, microsecond=0)
    price_create(resource="cpu", usd_per_hour=Decimal("0.048"), effective_from=start, actor=actor,
                 note="demo: a typical on-demand vCPU-hour; change it to yours")
    return True


def ensure_demo_tenant() -> str | None:
    """Once per database: a `demo` tenant with one key for the `demo` deployment.

    Returns the key (it is shown once and stored only as a hash) or None when it exists.
    """
    from tenants.models import Tenant
    from tenants.services import key_create, tenant_create

    if Tenant.objects.filter(name=DEMO_NAME).exists():
        return None
    actor = get_user_model().objects.filter(is_superuser=True).order_by("pk").first()
    with transaction.atomic():
        tenant = tenant_create(name=DEMO_NAME, actor=actor, display_name="Demo tenant", rpm_limit=600,
                               tpm_limit=200_000)
        _, secret = key_create(tenant=tenant, name="demo-key", actor=actor, deployments=[DEMO_NAME])
    return secret
