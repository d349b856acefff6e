import yaml
from django.core.management.base import BaseCommand, CommandError

from slo.models import Slo
from slo.openslo import definition_from_slo, export_slos
from slo.prometheus_rules import SOURCES, RulesDumper, RulesUnavailable, rule_groups


class Command(BaseCommand):
    help = "Write SLOs as OpenSLO v1 YAML (default) or as Prometheus rules."

    def add_arguments(self, parser):
        parser.add_argument("names", nargs="*", help="SLO names (default: every SLO)")
        parser.add_argument("-o", "--output", help="file to write (default: standard output)")
        parser.add_argument("--prometheus", choices=SOURCES, metavar="SOURCE",
                            help="write Prometheus recording and alerting rules on the gateway's or the "
                                 "replicas' metrics instead of OpenSLO")

    def handle(self, *args, names, output, prometheus, **options):
        slos = list(Slo.objects.select_related("deployment", "model").order_by("name"))
        if names:
            found = {slo.name: slo for slo in slos}
            missing = [name for name in names if name not in found]
            if missing:
                raise CommandError(f"No SLO named {', '.join(missing)}.")
            slos = [found[name] for name in names]
        if not slos:
            raise CommandError("There are no SLOs to export.")
        text = self.prometheus_rules(slos, prometheus) if prometheus else export_slos(slos)
        if output:
            with open(output, "w", encoding="utf-8") as handle:
                handle.write(text)
            self.stderr.write(f"Wrote {len(slos)} SLO(s) to {output}")
        else:
            self.stdout.write(text, ending="")

    def prometheus_rules(self, slos, source: str) -> str:
        groups = []
        for slo in slos:
            try:
                groups += rule_groups(definition_from_slo(slo), slo.deployment_names(), source)["groups"]
            except RulesUnavailable as exc:
                raise CommandError(f"{slo.name}: {exc}") from None
        return yaml.dump({"groups": groups}, Dumper=RulesDumper, sort_keys=False, width=100_000)
