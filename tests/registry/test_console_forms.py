"""Registry forms in the console: registering a version and moving an alias, for operators only,
with the registry's own refusals shown beside the field and nothing written."""

from __future__ import annotations

import pytest

from inferops.models import AuditEvent
from registry import services
from registry.models import Alias, ModelVersion
from tests.conftest import text_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def model():
    return services.model_create(name="llama-tiny", task="generate", actor=None)


def test_viewer_sees_no_forms_and_is_refused(client, make_user, model, tiny_llama_dir):
    client.force_login(make_user("viewer"))
    page = text_of(client.get(f"/models/{model.name}/"))
    assert "version-form" not in page and "alias-form" not in page
    assert client.post(f"/models/{model.name}/versions/new/", {"artifact_uri": str(tiny_llama_dir)}).status_code == 403
    assert client.post(f"/models/{model.name}/aliases/", {"alias": "champion", "version": "1"}).status_code == 403
    assert not ModelVersion.objects.exists()


def test_operator_registers_a_version_and_moves_an_alias(client, make_user, model, tiny_llama_dir):
    client.force_login(make_user("operator"))
    page = text_of(client.get(f"/models/{model.name}/"))
    assert 'id="version-form"' in page and 'id="alias-form"' not in page  # no version to point at yet
    response = client.post(f"/models/{model.name}/versions/new/",
                           {"artifact_uri": str(tiny_llama_dir), "description": "first"}, follow=True)
    assert response.status_code == 200
    version = ModelVersion.objects.get(model=model)
    assert version.number == 1 and version.description == "first"
    assert f"Registered llama-tiny v1 (LlamaForCausalLM, digest {version.digest[:12]}" in text_of(response)
    client.post(f"/models/{model.name}/versions/new/", {"artifact_uri": f"file://{tiny_llama_dir}"})

    response = client.post(f"/models/{model.name}/aliases/", {"alias": "champion", "version": "2"}, follow=True)
    assert "Alias champion now points at v2 (new alias)." in text_of(response)
    response = client.post(f"/models/{model.name}/aliases/", {"alias": "champion", "version": "1"}, follow=True)
    assert "Alias champion now points at v1 (was v2)." in text_of(response)
    assert Alias.objects.get(model=model, name="champion").version.number == 1
    assert list(AuditEvent.objects.filter(action__in=["version.register", "alias.set"])
                .values_list("action", flat=True).order_by("id")) == [
        "version.register", "version.register", "alias.set", "alias.set"]


@pytest.mark.parametrize(("uri", "expected"), [
    ("relative/dir", "Artifact URI 'relative/dir' must be an absolute path."),
    ("s3://bucket/model", "Artifact URI scheme s3:// cannot be validated by this control plane"),
    ("/does/not/exist", "/does/not/exist"),
])
def test_a_checkpoint_the_registry_refuses_shows_why_and_stores_nothing(client, make_user, model, uri, expected):
    client.force_login(make_user("operator"))
    response = client.post(f"/models/{model.name}/versions/new/", {"artifact_uri": uri})
    assert response.status_code == 400
    page = text_of(response)
    assert expected in page
    assert f'value="{uri}"' in page  # what was typed stays in the form
    assert not ModelVersion.objects.exists()
    assert not AuditEvent.objects.filter(action="version.register").exists()


def test_a_wrong_digest_or_bad_alias_is_refused_beside_its_field(client, make_user, model, tiny_llama_dir):
    client.force_login(make_user("operator"))
    response = client.post(f"/models/{model.name}/versions/new/",
                           {"artifact_uri": str(tiny_llama_dir), "sha256": "abc"})
    assert response.status_code == 400 and "Expected digest must be 64 hexadecimal characters." in text_of(response)
    response = client.post(f"/models/{model.name}/versions/new/",
                           {"artifact_uri": str(tiny_llama_dir), "sha256": "0" * 64})
    assert response.status_code == 400 and "Digest mismatch: expected 000000" in text_of(response)
    assert not ModelVersion.objects.exists()

    services.version_register(model=model, artifact_uri=str(tiny_llama_dir), actor=None)
    response = client.post(f"/models/{model.name}/aliases/", {"alias": "Champion!", "version": "1"})
    assert response.status_code == 400 and "'Champion!' is not a valid alias" in text_of(response)
    response = client.post(f"/models/{model.name}/aliases/", {"alias": "champion", "version": "7"})
    assert response.status_code == 400 and "7 is not one of the available choices" in text_of(response)
    assert not Alias.objects.exists()
