from django.db import migrations, models

# Request SLOs were fed by evaluation reading events by ingested_at; the usage pipeline adds each
# new event from now on. Back-filling them once (watermark NULL) covers what was ingested between.
_REBACKFILL = "UPDATE slo_slo SET watermark = NULL WHERE sli_kind <> 'ratio'"


class Migration(migrations.Migration):

    dependencies = [
        ('slo', '0004_insufficient_traffic'),
    ]

    operations = [
        migrations.AddField(
            model_name='slominute',
            name='stale',
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AddIndex(
            model_name='slominute',
            index=models.Index(condition=models.Q(('stale', True)), fields=['slo', 'minute'], name='slo_minute_stale'),
        ),
        migrations.RunSQL(_REBACKFILL, migrations.RunSQL.noop),
    ]
