"""The console's shared pieces: key/value and UTC filters and the log format setting (the plotly asset:
tests/test_console_assets.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from django.template import Context, Template


def render(source: str, **context) -> str:
    return Template("{% load console %}" + source).render(Context(context))


def test_engine_arguments_read_as_key_values_not_a_python_dict():
    html = render("{{ args|keyvalues:'defaults' }}", args={"max_num_seqs": 8, "enable_prefix_caching": False,
                                                           "dtype": "bfloat16", "<x>": [1, 2]})
    assert "{" not in html and "'" not in html and "False" not in html
    assert '<span class="k">enable_prefix_caching</span> no' in html
    assert '<span class="k">max_num_seqs</span> 8' in html
    assert "&lt;x&gt;" in html and "<x>" not in html  # escaped
    assert render("{{ args|keyvalues:'defaults' }}", args={}) == '<span class="muted">defaults</span>'


def test_times_are_utc_with_the_moment_for_the_local_hover():
    moment = datetime(2026, 12, 4, 13, 5, 9, tzinfo=timezone(timedelta(hours=1)))
    assert render("{{ t|utc }}", t=moment) == '<time datetime="2026-12-04T12:05:09+00:00">2026-12-04 12:05 UTC</time>'
    assert ">2026-12-04 12:05:09 UTC<" in render("{{ t|utc:'seconds' }}", t=moment.astimezone(UTC))
    assert render("{{ t|utc }}", t=None) == "—"


def test_control_plane_logs_are_json_lines_by_a_setting(tmp_path):
    """web, worker and beat log through Django's LOGGING: INFEROPS_LOG_FORMAT=json makes each line one
    JSON object, as the gateway's and the replicas' are (runtime/gateway/jsonlog.py)."""
    import json
    import os
    import subprocess
    import sys

    probe = ("import django, logging; django.setup(); from django.conf import settings; "
             "logging.getLogger('inferops.probe').warning('hello %s', 'there'); "
             "print(settings.CELERY_WORKER_HIJACK_ROOT_LOGGER)")
    for form, hijack in (("json", "False"), ("", "True")):
        env = {**os.environ, "INFEROPS_LOG_FORMAT": form, "DJANGO_SETTINGS_MODULE": "project.settings"}
        result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == hijack
        line = result.stderr.strip().splitlines()[-1]
        if form == "json":
            record = json.loads(line)
            assert (record["level"], record["logger"], record["message"]) == (
                "WARNING", "inferops.probe", "hello there")
        else:
            assert line.endswith("WARNING inferops.probe: hello there")
