"""The console's plotly.js: the partial bundle from npm when `make install` put it there, the plotly
package's full bundle otherwise, gzipped, under a URL that names the bundle."""

from __future__ import annotations

import gzip
import json
import logging
import re
from pathlib import Path

import pytest

from inferops.assets import full_bundle_path, plotly_bundle

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh_bundle():
    plotly_bundle.cache_clear()
    yield
    plotly_bundle.cache_clear()


@pytest.fixture
def viewer(client, make_user):
    client.force_login(make_user("viewer"))
    return client


def bundle_url(client) -> str:
    """The script tag's URL on a chart page, as a browser reads it."""
    text = client.get("/costs/").content.decode()
    return re.search(r'<script defer src="(/assets/plotly-[0-9a-f]{12}\.min\.js)"', text).group(1)


def test_the_partial_bundle_is_served_gzipped_and_cached_for_good(viewer, settings, tmp_path, fresh_bundle):
    partial = tmp_path / "plotly-basic.min.js"
    partial.write_text("/* plotly.js (basic - minified) */ window.Plotly = {};" * 100)
    settings.PLOTLY_PARTIAL_BUNDLE = partial
    url = bundle_url(viewer)
    plain = viewer.get(url)
    packed = viewer.get(url, HTTP_ACCEPT_ENCODING="gzip, deflate, br")
    assert plain.status_code == packed.status_code == 200
    assert plain.content == partial.read_bytes()
    assert "Content-Encoding" not in plain and packed["Content-Encoding"] == "gzip"
    assert gzip.decompress(packed.content) == plain.content and len(packed.content) < len(plain.content) / 2
    assert packed["Vary"] == "Accept-Encoding"
    assert packed["Cache-Control"] == "public, max-age=31536000, immutable"


def test_a_new_bundle_is_a_new_url_and_the_old_url_leads_to_it(viewer, settings, tmp_path, fresh_bundle):
    settings.PLOTLY_PARTIAL_BUNDLE = tmp_path / "first.js"
    settings.PLOTLY_PARTIAL_BUNDLE.write_text("window.Plotly = {version: 1};")
    old = bundle_url(viewer)
    settings.PLOTLY_PARTIAL_BUNDLE = tmp_path / "second.js"
    settings.PLOTLY_PARTIAL_BUNDLE.write_text("window.Plotly = {version: 2};")
    plotly_bundle.cache_clear()  # a restart after the upgrade
    new = bundle_url(viewer)
    assert new != old
    moved = viewer.get(old)
    assert moved.status_code == 302 and moved["Location"] == new and moved["Cache-Control"] == "no-cache"
    assert viewer.get(new).content == b"window.Plotly = {version: 2};"


def test_without_npm_the_full_bundle_serves_with_one_warning(viewer, settings, tmp_path, fresh_bundle,
                                                            caplog):
    settings.PLOTLY_PARTIAL_BUNDLE = tmp_path / "missing" / "plotly-basic.min.js"
    with caplog.at_level(logging.WARNING, logger="inferops.assets"):
        url = bundle_url(viewer)
        served = viewer.get(url)
        viewer.get(url)
    assert served.status_code == 200 and served.content == full_bundle_path().read_bytes()
    warnings = [r for r in caplog.records if r.name == "inferops.assets"]
    assert len(warnings) == 1 and "missing" in warnings[0].getMessage()
    assert "full bundle" in warnings[0].getMessage()


def test_the_npm_pin_is_the_plotly_js_the_python_package_bundles():
    """The partial bundle and the fallback are the same plotly.js, so a chart draws alike with either."""
    pinned = json.loads((ROOT / "package.json").read_text())["dependencies"]["plotly.js-basic-dist-min"]
    locked = json.loads((ROOT / "package-lock.json").read_text())["packages"]["node_modules/plotly.js-basic-dist-min"]
    bundled = re.search(r"plotly\.js v(\S+)", full_bundle_path().read_text()[:200]).group(1)
    assert pinned == locked["version"] == bundled
