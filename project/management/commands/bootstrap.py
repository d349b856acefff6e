from django.core.management.base import BaseCommand

from project.bootstrap import ensure_admin


class Command(BaseCommand):
    help = "Create the first admin user on a fresh database and print its password once."

    def handle(self, *args, **options):
        password = ensure_admin()
        if password:
            self.stdout.write(f"Created user 'admin' with password: {password}")
        else:
            self.stdout.write("An admin user already exists; nothing to do.")
