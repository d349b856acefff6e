import pytest
from django.core.management import call_command


def test_openapi_schema_is_valid_and_describes_errors(tmp_path, db):
    out = tmp_path / "schema.yaml"
    # --validate checks the document against the OpenAPI 3 JSON schema; warnings fail too.
    call_command("spectacular", "--validate", "--fail-on-warn", "--file", str(out))
    import yaml

    schema = yaml.safe_load(out.read_text())
    post = schema["paths"]["/api/v1/models/{name}/versions/"]["post"]
    assert {"201", "400", "401", "403", "404"} <= set(post["responses"])
    assert "/api/v1/audit/" in schema["paths"]


@pytest.mark.django_db
def test_schema_and_docs_are_served(client):
    assert client.get("/api/schema/").status_code == 200
    docs = client.get("/api/docs/")
    assert docs.status_code == 200
    assert b"cdn" not in docs.content.lower()
