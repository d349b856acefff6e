import sys
from pathlib import Path

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from inferops.api import Conflict
from slo.openslo import OpenSloRefused, import_text


class Command(BaseCommand):
    help = ("Create SLOs from OpenSLO v1 YAML files (kinds Service, SLI, SLO, AlertPolicy, AlertCondition), "
            "all in one transaction: every SLO of every file, or none.")

    def add_arguments(self, parser):
        parser.add_argument("files", nargs="+", type=Path, help="OpenSLO YAML files ('-' reads standard input)")

    def handle(self, *args, files, **options):
        texts = []
        for path in files:
            try:
                texts.append(sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8"))
            except OSError as exc:
                raise CommandError(f"{path}: {exc.strerror}") from None
        try:
            created = import_text("\n---\n".join(texts), actor=None)
        except OpenSloRefused as exc:
            for problem in exc.problems:
                self.stderr.write(str(problem))
            raise CommandError(f"{exc}; nothing was imported.") from None
        except ValidationError as exc:
            for field, messages in exc.message_dict.items():
                self.stderr.write(f"{field}: {' '.join(messages)}")
            raise CommandError("An SLO failed validation; nothing was imported.") from None
        except (ValueError, Conflict) as exc:
            raise CommandError(f"{getattr(exc, 'detail', exc)}; nothing was imported.") from None
        for slo in created:
            self.stdout.write(f"Created SLO {slo.name} (id {slo.pk})")
