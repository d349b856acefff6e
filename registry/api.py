"""REST API for CI pipelines: models, versions and aliases."""

from __future__ import annotations

from django.db.models import Prefetch, Q
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.response import Response

from inferops.api import CONFLICT, ERRORS, TOO_LARGE, PlainMetadata
from inferops.validators import slug_validator
from registry import services
from registry.checkpoint import CheckpointError
from registry.models import Alias, ModelVersion, RegisteredModel


class VersionSerializer(serializers.ModelSerializer):
    model = serializers.CharField(source="model.name", read_only=True)
    aliases = serializers.SerializerMethodField()

    class Meta:
        model = ModelVersion
        fields = [
            "model", "number", "artifact_uri", "status", "digest", "description", "aliases",
            "architecture", "parameter_count", "hidden_size", "num_layers",
            "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size", "max_context",
            "dtype", "weight_bytes", "kv_cache_bytes_per_token", "has_tokenizer",
            "has_chat_template", "manifest", "created_at",
        ]
        read_only_fields = fields

    def get_aliases(self, version) -> list[str]:
        return sorted(alias.name for alias in version.aliases.all())


class VersionCreateSerializer(serializers.Serializer):
    artifact_uri = serializers.CharField(max_length=1024)
    sha256 = serializers.RegexField(
        r"^[0-9a-fA-F]{64}$", required=False, allow_null=True,
        error_messages={"invalid": "sha256 must be 64 hexadecimal characters."},
    )
    description = serializers.CharField(required=False, allow_blank=True, default="")


class ModelSerializer(serializers.ModelSerializer):
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    tags = serializers.ListField(
        child=serializers.CharField(max_length=63, validators=[slug_validator]),
        required=False, max_length=50,
    )
    latest_version = serializers.SerializerMethodField()
    aliases = serializers.SerializerMethodField()

    class Meta:
        model = RegisteredModel
        fields = ["name", "task", "description", "owner", "tags", "latest_version", "aliases",
                  "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]

    def get_latest_version(self, model) -> int | None:
        versions = model.versions.all()
        return max((v.number for v in versions), default=None)

    def get_aliases(self, model) -> dict[str, int]:
        return {alias.name: alias.version.number for alias in model.aliases.all()}


class ModelUpdateSerializer(serializers.ModelSerializer):
    tags = serializers.ListField(
        child=serializers.CharField(max_length=63, validators=[slug_validator]),
        required=False, max_length=50,
    )

    class Meta:
        model = RegisteredModel
        fields = ["description", "owner", "tags"]


class AliasSerializer(serializers.Serializer):
    alias = serializers.CharField(source="name", read_only=True)
    model = serializers.CharField(source="model.name", read_only=True)
    version = serializers.IntegerField(source="version.number", read_only=True)
    updated_at = serializers.DateTimeField(read_only=True)


class AliasSetSerializer(serializers.Serializer):
    version = serializers.IntegerField(min_value=1)


class AliasSetResponseSerializer(AliasSerializer):
    previous_version = serializers.IntegerField(allow_null=True, read_only=True)


def model_queryset():
    return RegisteredModel.objects.prefetch_related(
        "versions", Prefetch("aliases", queryset=Alias.objects.select_related("version"))
    )


def get_model(name: str) -> RegisteredModel:
    return get_object_or_404(model_queryset(), name=name)


def checkpoint_error_response(exc: CheckpointError) -> Response:
    return Response({exc.field: [str(exc)]}, status=status.HTTP_400_BAD_REQUEST)


def filter_models(queryset, params):
    if search := params.get("search"):
        queryset = queryset.filter(
            Q(name__icontains=search) | Q(description__icontains=search) | Q(owner__icontains=search)
        )
    if task := params.get("task"):
        queryset = queryset.filter(task=task)
    if tag := params.get("tag"):
        queryset = queryset.filter(tags__contains=[tag])
    if owner := params.get("owner"):
        queryset = queryset.filter(owner=owner)
    return queryset


@extend_schema(tags=["models"])
class ModelViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = ModelSerializer
    lookup_field = "name"

    def get_queryset(self):
        # The list's filters narrow the list only; a model's own URL finds it whatever the query string.
        if self.action == "list":
            return filter_models(model_queryset(), self.request.query_params)
        return model_queryset()

    @extend_schema(parameters=[
        OpenApiParameter("search", OpenApiTypes.STR, description="Substring of name, description or owner."),
        OpenApiParameter("task", OpenApiTypes.STR, enum=["generate", "embed"]),
        OpenApiParameter("tag", OpenApiTypes.STR, description="Only models carrying this tag."),
        OpenApiParameter("owner", OpenApiTypes.STR),
    ], responses={200: ModelSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(responses={201: ModelSerializer, **ERRORS, **CONFLICT, **TOO_LARGE})
    def create(self, request, *args, **kwargs):
        serializer = ModelSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        model = services.model_create(actor=request.user, **serializer.validated_data)
        return Response(ModelSerializer(get_model(model.name)).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: ModelSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=ModelUpdateSerializer, responses={200: ModelSerializer, **ERRORS})
    def partial_update(self, request, name: str):
        model = self.get_object()
        serializer = ModelUpdateSerializer(model, data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        services.model_update(model=model, actor=request.user, **serializer.validated_data)
        return Response(ModelSerializer(get_model(name)).data)


@extend_schema(tags=["versions"])
class VersionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = VersionSerializer
    lookup_field = "number"

    def get_queryset(self):
        queryset = get_model(self.kwargs["name"]).versions.prefetch_related("aliases").select_related("model")
        if self.action == "list":
            queryset = queryset.order_by("-number")
            if version_status := self.request.query_params.get("status"):
                queryset = queryset.filter(status=version_status)
        return queryset

    @extend_schema(
        parameters=[OpenApiParameter("status", OpenApiTypes.STR, enum=["ready", "deprecated", "archived"])],
        responses={200: VersionSerializer(many=True), **ERRORS},
    )
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=VersionCreateSerializer,
                   responses={201: VersionSerializer, **ERRORS, **TOO_LARGE})
    def create(self, request, name: str):
        model = get_model(name)
        serializer = VersionCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            version = services.version_register(
                model=model, artifact_uri=data["artifact_uri"], actor=request.user,
                expected_sha256=data.get("sha256"), description=data["description"],
            )
        except CheckpointError as exc:
            return checkpoint_error_response(exc)
        return Response(VersionSerializer(version).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: VersionSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)


@extend_schema(tags=["aliases"])
class AliasViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    # A model's aliases: the list is one page (a model has few), an alias reads as its version.
    serializer_class = AliasSerializer
    metadata_class = PlainMetadata  # OPTIONS without `actions`, as the APIViews before it answered
    pagination_class = None
    lookup_field = "alias"

    def get_queryset(self):
        return get_model(self.kwargs["name"]).aliases.select_related("version", "model")

    @extend_schema(responses={200: AliasSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(responses={200: VersionSerializer, **ERRORS},
                   description="The version the alias points at.")
    def retrieve(self, request, name: str, alias: str):
        found = get_object_or_404(self.get_queryset(), name=alias)
        return Response(VersionSerializer(found.version).data)

    @extend_schema(request=AliasSetSerializer, responses={200: AliasSetResponseSerializer, **ERRORS},
                   description="Point the alias at a version; answers the previous version.")
    def update(self, request, name: str, alias: str):
        model = get_model(name)
        try:
            slug_validator(alias)
        except Exception as exc:  # django ValidationError; answer in DRF's field shape
            return Response({"alias": list(exc.messages)}, status=status.HTTP_400_BAD_REQUEST)
        serializer = AliasSetSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        version = get_object_or_404(model.versions, number=serializer.validated_data["version"])
        found, previous = services.alias_set(model=model, name=alias, version=version, actor=request.user)
        body = AliasSerializer(found).data
        body["previous_version"] = previous.number if previous else None
        return Response(body)

    @extend_schema(responses={204: None, **ERRORS})
    def destroy(self, request, name: str, alias: str):
        found = get_object_or_404(self.get_queryset(), name=alias)
        services.alias_delete(alias=found, actor=request.user)
        return Response(status=status.HTTP_204_NO_CONTENT)
