"""The console's shared filters: mappings as key/value lists, and times in UTC with the local time on hover."""

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


def test_plotly_is_served_gzipped_to_browsers_that_accept_it(client):
    import gzip

    plain = client.get("/assets/plotly.min.js")
    packed = client.get("/assets/plotly.min.js", HTTP_ACCEPT_ENCODING="gzip, deflate, br")
    assert plain.status_code == packed.status_code == 200
    assert "Content-Encoding" not in plain and packed["Content-Encoding"] == "gzip"
    assert gzip.decompress(packed.content) == plain.content and len(packed.content) < len(plain.content) / 2
    assert packed["Vary"] == "Accept-Encoding" and "max-age=604800" in packed["Cache-Control"]
