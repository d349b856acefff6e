"""REST API of eval sets: the sets, and their immutable versions uploaded as JSONL."""

from __future__ import annotations

import json

from django.conf import settings
from django.db.models import Max
from django.shortcuts import get_object_or_404
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, mixins, parsers, renderers, serializers, status, viewsets
from rest_framework.response import Response

from evals.choices import Scorer
from evals.models import EvalSet, EvalSetVersion
from evals.sets import jsonl, services
from inferops.api import CONFLICT, ERRORS, TOO_LARGE, AuthenticateBeforeFormat, RejectUnknownFields
from inferops.validators import slug_validator
from registry.models import RegisteredModel

JSONL = "application/x-ndjson"
HOW_TO_SEND = (f"Send the JSONL as the body with Content-Type: {JSONL}, or as the `file` of a "
               "multipart/form-data form.")


class BodyTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_detail = "Request body too large."
    default_code = "too_large"


class JsonLinesParser(parsers.BaseParser):
    """The body as the JSONL file's bytes (evals.sets.jsonl checks them), up to the upload limit."""

    media_type = JSONL

    def parse(self, stream, media_type=None, parser_context=None) -> bytes:
        limit = settings.INFEROPS_EVALSET_MAX_BYTES
        raw = stream.read(limit + 1) if stream is not None else b""
        if len(raw) > limit:
            raise BodyTooLarge(str(jsonl.too_large(limit)))
        return raw


class JsonLinesRenderer(renderers.BaseRenderer):
    """A version's JSONL exactly as uploaded (?format=jsonl); anything else, an error say, as JSON."""

    media_type = JSONL
    format = "jsonl"
    charset = "utf-8"

    def render(self, data, accepted_media_type=None, renderer_context=None) -> bytes:
        return data.encode("utf-8") if isinstance(data, str) else json.dumps(data).encode("utf-8")


def model_names_field(**kwargs) -> serializers.SlugRelatedField:
    return serializers.SlugRelatedField(
        many=True, slug_field="name", queryset=RegisteredModel.objects.all(),
        help_text="Models whose new versions are scored on this set's latest version by themselves.", **kwargs)


class EvalSetSerializer(serializers.ModelSerializer):
    # A plain field: a taken name is a 409 from the service, not the unique validator's 400.
    name = serializers.CharField(max_length=63, validators=[slug_validator])
    scorer = serializers.ChoiceField(Scorer.choices, help_text="The scorer of cases that name none.")
    default_for = model_names_field(required=False)
    latest_version = serializers.SerializerMethodField()

    class Meta:
        model = EvalSet
        fields = ["name", "description", "scorer", "default_for", "latest_version", "created_at", "updated_at"]
        read_only_fields = ["created_at", "updated_at"]

    def get_latest_version(self, eval_set) -> int | None:
        return getattr(eval_set, "latest_number", None)


class EvalSetCreateSerializer(RejectUnknownFields, EvalSetSerializer):
    pass


class EvalSetUpdateSerializer(RejectUnknownFields, serializers.ModelSerializer):
    scorer = serializers.ChoiceField(
        Scorer.choices, help_text="For versions uploaded from now on; stored cases keep theirs.")
    default_for = model_names_field()

    class Meta:
        model = EvalSet
        fields = ["description", "scorer", "default_for"]


class EvalSetVersionSerializer(serializers.ModelSerializer):
    eval_set = serializers.CharField(source="eval_set.name", read_only=True)
    version = serializers.IntegerField(source="number", read_only=True)
    cases = serializers.IntegerField(source="case_count", read_only=True)
    created_by = serializers.CharField(source="created_by.username", default=None, allow_null=True, read_only=True)
    download = serializers.SerializerMethodField(help_text="The JSONL exactly as uploaded.")

    class Meta:
        model = EvalSetVersion
        fields = ["eval_set", "version", "cases", "sha256", "created_by", "created_at", "download"]
        read_only_fields = fields

    def get_download(self, version) -> str:
        path = reverse("api-evalset-version-detail", args=[version.eval_set.name, version.number])
        return f"{path}?format=jsonl"


class EvalSetVersionDetailSerializer(EvalSetVersionSerializer):
    items = serializers.JSONField(read_only=True, help_text="The cases as checked, in file order: id, prompt or "
                                  "messages, scorer, max_tokens, and the scorer's own keys.")

    class Meta(EvalSetVersionSerializer.Meta):
        fields = [*EvalSetVersionSerializer.Meta.fields, "items"]
        read_only_fields = fields


class EvalSetUploadSerializer(serializers.Serializer):
    file = serializers.FileField(help_text="The JSONL: one case per line.")


class EvalSetLineErrorSerializer(serializers.Serializer):
    line = serializers.IntegerField(allow_null=True, help_text="From 1; null when it concerns the whole file.")
    error = serializers.CharField(help_text="What is wrong and what to do.")


class EvalSetFileErrorsSerializer(serializers.Serializer):
    errors = EvalSetLineErrorSerializer(many=True, required=False)  # absent from a form without `file`


FILE_REFUSED = {400: OpenApiResponse(EvalSetFileErrorsSerializer, description=(
    "The file is refused whole and nothing is stored: every bad line, each with its reason. (A multipart "
    "form without `file` answers DRF's field errors instead.)"))}
UNSUPPORTED = {415: OpenApiResponse(ERRORS[400].response, description=HOW_TO_SEND)}


def evalset_queryset():
    return (EvalSet.objects.prefetch_related("default_for").annotate(latest_number=Max("versions__number"))
            .order_by("name"))


def get_evalset(name: str) -> EvalSet:
    return get_object_or_404(evalset_queryset(), name=name)


@extend_schema(tags=["evalsets"])
class EvalSetViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = EvalSetSerializer
    lookup_field = "name"

    def get_queryset(self):
        return evalset_queryset()

    @extend_schema(responses={200: EvalSetSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(request=EvalSetCreateSerializer,
                   responses={201: EvalSetSerializer, **ERRORS, **CONFLICT, **TOO_LARGE})
    def create(self, request, *args, **kwargs):
        serializer = EvalSetCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        eval_set = services.evalset_create(actor=request.user, **serializer.validated_data)
        return Response(EvalSetSerializer(get_evalset(eval_set.name)).data, status=status.HTTP_201_CREATED)

    @extend_schema(responses={200: EvalSetSerializer, **ERRORS})
    def retrieve(self, request, *args, **kwargs):
        return super().retrieve(request, *args, **kwargs)

    @extend_schema(request=EvalSetUpdateSerializer, responses={200: EvalSetSerializer, **ERRORS})
    def partial_update(self, request, name: str):
        eval_set = self.get_object()
        serializer = EvalSetUpdateSerializer(eval_set, data=request.data, partial=True)
        serializer.is_valid(raise_exception=True)
        services.evalset_update(eval_set=eval_set, actor=request.user, **serializer.validated_data)
        return Response(EvalSetSerializer(get_evalset(name)).data)


def uploaded_file(request) -> bytes:
    """The JSONL a request carries, as the body or a multipart `file`; 413 over the limit, 415 otherwise."""
    if request.content_type.startswith("multipart/form-data"):
        serializer = EvalSetUploadSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        upload = serializer.validated_data["file"]
        if upload.size > settings.INFEROPS_EVALSET_MAX_BYTES:
            raise BodyTooLarge(str(jsonl.too_large(settings.INFEROPS_EVALSET_MAX_BYTES)))
        return upload.read()
    try:
        data = request.data
    except exceptions.UnsupportedMediaType:
        raise exceptions.UnsupportedMediaType(request.content_type, HOW_TO_SEND) from None
    return data if isinstance(data, bytes) else b""  # an empty body parses as {}


@extend_schema(tags=["evalsets"])
class EvalSetVersionViewSet(AuthenticateBeforeFormat, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                            viewsets.GenericViewSet):
    # Versions are immutable: no update or delete is routed (405).
    serializer_class = EvalSetVersionSerializer
    lookup_field = "number"
    # The middleware lets an upload's body past the usual limit (inferops.middleware.body_limit).
    max_body_bytes = staticmethod(services.upload_body_limit)
    parser_classes = [JsonLinesParser, parsers.MultiPartParser]

    def get_queryset(self):
        queryset = get_evalset(self.kwargs["name"]).versions.select_related("eval_set", "created_by")
        if self.action == "list":
            return queryset.order_by("-number").defer("content", "items")
        return queryset

    def get_renderers(self):
        if getattr(self, "action", None) == "retrieve":
            return [renderers.JSONRenderer(), JsonLinesRenderer()]
        return super().get_renderers()

    @extend_schema(responses={200: EvalSetVersionSerializer(many=True), **ERRORS})
    def list(self, request, *args, **kwargs):
        return super().list(request, *args, **kwargs)

    @extend_schema(
        request={JSONL: OpenApiTypes.BINARY, "multipart/form-data": EvalSetUploadSerializer},
        responses={201: EvalSetVersionSerializer, **ERRORS, **FILE_REFUSED, **TOO_LARGE, **UNSUPPORTED},
        description="Upload the set's next version: JSONL, one case per line. A file with any bad line is "
                    "refused whole and names every one.",
    )
    def create(self, request, name: str):
        eval_set = get_evalset(name)
        raw = uploaded_file(request)
        try:
            version = services.version_upload(eval_set=eval_set, raw=raw, actor=request.user)
        except jsonl.FileTooLarge as exc:
            raise BodyTooLarge(str(exc)) from None
        except jsonl.BadFile as exc:
            return Response({"errors": exc.errors}, status=status.HTTP_400_BAD_REQUEST)
        return Response(EvalSetVersionSerializer(version).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        responses={200: EvalSetVersionDetailSerializer, **ERRORS,
                   (200, JSONL): OpenApiResponse(OpenApiTypes.STR, description="The JSONL exactly as uploaded.")},
        description="The version with its cases; `?format=jsonl` (or `Accept: application/x-ndjson`) answers the "
                    "JSONL exactly as uploaded (its sha256 is the version's).",
    )
    def retrieve(self, request, name: str, number: int):
        version = self.get_object()
        if request.accepted_renderer.format == JsonLinesRenderer.format:
            filename = f"{version.eval_set.name}-v{version.number}.jsonl"
            return Response(version.content, headers={"Content-Disposition": f'attachment; filename="{filename}"'})
        return Response(EvalSetVersionDetailSerializer(version).data)
