from django.contrib.postgres.fields import ArrayField
from django.db import models

from inferops.models import Authored, Created
from inferops.validators import slug_validator
from registry.choices import Task, VersionStatus


class RegisteredModel(Authored):
    name = models.CharField(max_length=63, unique=True, validators=[slug_validator])
    task = models.CharField(max_length=16, choices=Task.choices)
    description = models.TextField(blank=True)
    owner = models.CharField(max_length=100, blank=True, help_text="Team or person responsible.")
    tags = ArrayField(models.CharField(max_length=63, validators=[slug_validator]), default=list, blank=True)

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["task"])]

    def __str__(self) -> str:
        return self.name

    def latest_version(self):
        return self.versions.order_by("-number").first()


class ModelVersion(Created):
    model = models.ForeignKey(RegisteredModel, on_delete=models.CASCADE, related_name="versions")
    number = models.PositiveIntegerField()
    artifact_uri = models.CharField(max_length=1024)
    status = models.CharField(max_length=16, choices=VersionStatus.choices, default=VersionStatus.READY)
    digest = models.CharField(max_length=64, help_text="sha256 of the artifact's file manifest.")
    manifest = models.JSONField(default=list, help_text="[{path, size, sha256}] sorted by path.")
    description = models.TextField(blank=True)
    # Facts read from the checkpoint at registration, without loading its weights.
    architecture = models.CharField(max_length=64)
    parameter_count = models.BigIntegerField()
    hidden_size = models.PositiveIntegerField()
    num_layers = models.PositiveIntegerField()
    num_attention_heads = models.PositiveIntegerField()
    num_kv_heads = models.PositiveIntegerField()
    head_dim = models.PositiveIntegerField()
    vocab_size = models.PositiveIntegerField()
    max_context = models.PositiveIntegerField()
    dtype = models.CharField(max_length=16)
    weight_bytes = models.BigIntegerField()
    kv_cache_bytes_per_token = models.BigIntegerField()
    has_tokenizer = models.BooleanField()
    has_chat_template = models.BooleanField()

    class Meta:
        ordering = ["model__name", "-number"]
        constraints = [
            models.UniqueConstraint(fields=["model", "number"], name="unique_version_number_per_model")
        ]

    def __str__(self) -> str:
        return f"{self.model.name} v{self.number}"

    def kv_cache_bytes(self, tokens: int) -> int:
        return self.kv_cache_bytes_per_token * tokens


class Alias(models.Model):
    model = models.ForeignKey(RegisteredModel, on_delete=models.CASCADE, related_name="aliases")
    name = models.CharField(max_length=63, validators=[slug_validator])
    version = models.ForeignKey(ModelVersion, on_delete=models.CASCADE, related_name="aliases")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["model__name", "name"]
        constraints = [models.UniqueConstraint(fields=["model", "name"], name="unique_alias_per_model")]

    def __str__(self) -> str:
        return f"{self.model.name}@{self.name}"
