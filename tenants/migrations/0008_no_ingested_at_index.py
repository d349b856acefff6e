from django.db import migrations


class Migration(migrations.Migration):
    """Nothing reads events by ingested_at any more: the usage pipeline folds each batch as it is stored."""

    dependencies = [
        ('tenants', '0007_usageevent_client_request_id_ttft_source'),
    ]

    operations = [
        migrations.RemoveIndex(
            model_name='usageevent',
            name='usage_event_ingested_brin',
        ),
    ]
