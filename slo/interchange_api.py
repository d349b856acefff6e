"""REST endpoints for SLO interchange: OpenSLO v1 import and export, Prometheus rule export."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers, status
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser, JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from inferops.api import CONFLICT, ERRORS, TOO_LARGE
from slo.api import SloSerializer, api_validation_error, get_slo, slo_queryset
from slo.openslo import OpenSloRefused, export_slos, import_text
from slo.prometheus_rules import SOURCES, RulesUnavailable, slo_rules

YAML_TYPE = "application/yaml"


class YamlTextParser(BaseParser):
    """The request body as text: `curl --data-binary @slos.yaml -H 'Content-Type: application/yaml'`."""

    media_type = "*/*"

    def parse(self, stream, media_type=None, parser_context=None):
        try:
            return stream.read().decode("utf-8") if stream else ""
        except UnicodeDecodeError:
            raise ParseError("The body is not UTF-8 text.") from None


def yaml_response(text: str, filename: str) -> HttpResponse:
    response = HttpResponse(text, content_type=f"{YAML_TYPE}; charset=utf-8")
    response["Content-Disposition"] = f'inline; filename="{filename}"'
    return response


REFUSED = OpenApiResponse(inline_serializer("OpenSloRefused", {
    "detail": serializers.CharField(),
    "unsupported": serializers.ListField(required=False, child=inline_serializer("OpenSloProblem", {
        "document": serializers.IntegerField(), "kind": serializers.CharField(), "name": serializers.CharField(),
        "field": serializers.CharField(), "message": serializers.CharField()})),
}), description="Every field inferops does not support, each with its path in its document; a body that is not "
                "OpenSLO at all (not YAML, not UTF-8, empty) has the `detail` alone.")


@extend_schema(tags=["slos"])
class SloImport(APIView):
    # JSON first so that a JSON body {"yaml": "..."} works too; anything else is read as YAML text.
    parser_classes = [JSONParser, YamlTextParser]

    @extend_schema(
        request={YAML_TYPE: OpenApiTypes.STR, "application/json": inline_serializer(
            "OpenSloImport", {"yaml": serializers.CharField()})},
        responses={201: inline_serializer("OpenSloImported", {"created": SloSerializer(many=True)}),
                   **ERRORS, 400: REFUSED, **CONFLICT, **TOO_LARGE},
        description="Creates every SLO of an OpenSLO v1 YAML stream (kinds Service, SLI, SLO, AlertPolicy, "
                    "AlertCondition) in one transaction: all or none. Unsupported fields are listed, each "
                    "with its path, in one 400.",
    )
    def post(self, request):
        text = request.data.get("yaml") if isinstance(request.data, dict) else request.data
        if not isinstance(text, str) or not text.strip():
            return Response({"detail": "Send OpenSLO YAML as the body (Content-Type: application/yaml) "
                                       'or as {"yaml": "..."}.'}, status=status.HTTP_400_BAD_REQUEST)
        try:
            created = import_text(text, actor=request.user)
        except ValueError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_400_BAD_REQUEST)
        except OpenSloRefused as exc:
            return Response(exc.as_json(), status=status.HTTP_400_BAD_REQUEST)
        except DjangoValidationError as exc:
            raise api_validation_error(exc) from None
        rows = slo_queryset().filter(pk__in=[slo.pk for slo in created]).order_by("name")
        return Response({"created": SloSerializer(rows, many=True).data}, status=status.HTTP_201_CREATED)


@extend_schema(tags=["slos"])
class SloOpenSlo(APIView):
    @extend_schema(responses={(200, YAML_TYPE): OpenApiTypes.STR, **ERRORS},
                   description="The SLO as OpenSLO v1 YAML (a Service and an SLO document).")
    def get(self, request, pk: int):
        slo = get_slo(pk)
        return yaml_response(export_slos([slo]), f"{slo.name}.openslo.yaml")


@extend_schema(tags=["slos"])
class SloPrometheusRules(APIView):
    @extend_schema(
        parameters=[OpenApiParameter("source", OpenApiTypes.STR, enum=list(SOURCES),
                                     description="Whose metrics the rules read: the gateway's (default) "
                                                 "or the replicas' vLLM metrics.")],
        responses={(200, YAML_TYPE): OpenApiTypes.STR, **ERRORS,
                   422: OpenApiResponse(description="The SLO has no form on those metrics (the detail says why).")},
        description="Recording rules for the SLI's error ratio and multiwindow burn-rate alerting rules, "
                    "as a file `promtool check rules` accepts.",
    )
    def get(self, request, pk: int):
        slo = get_slo(pk)
        source = request.query_params.get("source", "gateway")
        if source not in SOURCES:
            return Response({"source": [f"One of: {', '.join(SOURCES)}."]}, status=status.HTTP_400_BAD_REQUEST)
        try:
            text = slo_rules(slo, source)
        except RulesUnavailable as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_422_UNPROCESSABLE_ENTITY)
        return yaml_response(text, f"{slo.name}.rules.yaml")
