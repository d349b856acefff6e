"""Logging filters named in settings.LOGGING."""

from __future__ import annotations

import logging


class RefusalWithoutTraceback(logging.Filter):
    """django.request logs a refused request (PermissionDenied, 403) as a warning with the exception's
    traceback; a viewer opening an operator's page is no bug, and one line says all of it."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "status_code", None) == 403:
            record.exc_info = None
            record.exc_text = None
        return True
