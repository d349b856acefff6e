"""The console's plotly.js bundle, read once per process.

The partial bundle (scatter, bar and pie traces; `make install` and the image's assets stage put
it there with npm, pinned in package.json) parses in a quarter of the full bundle's time, which
dominated a cold chart page. Without it (no npm on this machine) the full bundle that ships in
the plotly Python package serves instead, so charts never break.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Bundle:
    plain: bytes
    gzipped: bytes
    digest: str  # in the URL, so a new bundle is a new URL and the old one may be cached for good


def full_bundle_path() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def _bundle_bytes() -> bytes:
    partial = Path(settings.PLOTLY_PARTIAL_BUNDLE)
    if partial.is_file():
        return partial.read_bytes()
    logger.warning("%s is missing (`make install` runs npm ci for it): serving plotly's full bundle, "
                   "four times the size and slower to draw charts", partial)
    return full_bundle_path().read_bytes()


@functools.cache
def plotly_bundle() -> Bundle:
    plain = _bundle_bytes()
    return Bundle(plain=plain, gzipped=gzip.compress(plain, compresslevel=6, mtime=0),
                  digest=hashlib.sha256(plain).hexdigest()[:12])
