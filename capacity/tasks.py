"""Celery tasks of elastic capacity: thin wrappers that take ids and call one function."""

