from django.db import models


class Task(models.TextChoices):
    GENERATE = "generate", "Text generation"
    EMBED = "embed", "Embeddings"


class VersionStatus(models.TextChoices):
    # A version is registered only after its checkpoint validated, so it starts ready.
    READY = "ready", "Ready"
    DEPRECATED = "deprecated", "Deprecated"
    ARCHIVED = "archived", "Archived"
