from django.apps import AppConfig, apps
from django.db.models.signals import post_migrate


def create_role_groups(sender, **kwargs) -> None:
    # post_migrate also follows the flush between transactional tests, so the groups exist
    # whenever the tables do; a data migration would be wiped by that flush.
    from django.contrib.auth.models import Group

    from inferops.roles import ROLES

    for name in ROLES:
        Group.objects.get_or_create(name=name)


class InferopsConfig(AppConfig):
    name = "inferops"
    verbose_name = "inferops platform"

    def ready(self) -> None:
        # Importing the Celery app here makes `task.delay()` in web processes use the
        # configured broker instead of Celery's default app.
        from inferops import celery  # noqa: F401

        # The groups belong to auth's tables: create them whenever auth's are migrated or flushed.
        post_migrate.connect(create_role_groups, sender=apps.get_app_config("auth"))
