from django.db import migrations, models

# From here on the usage pipeline adds each new event into UsageHour at ingest. The hours that
# events ingested since the last roll-up touched are rolled up once more the old way, so that
# nothing ingested before the pipeline is missed (a frozen copy of the old statements).
_TOUCHED = """
    SELECT DISTINCT deployment, date_trunc('hour', time) FROM tenants_usageevent
    WHERE ingested_at >= %s - interval '2 minutes' AND deployment IS NOT NULL
"""
_ALL_HOURS = """
    SELECT DISTINCT deployment, date_trunc('hour', minute) FROM tenants_usageminute WHERE deployment IS NOT NULL
"""
_SUCCEEDED = "(e.status < 400 AND e.error_kind IS NULL)"
_LATENCY = ("ttft_ms", "tpot_ms", "e2e_ms")
_MEASURED = " AND ".join(f"(s.{v} IS NULL OR e.{v} IS NOT NULL)" for v in _LATENCY)
_MET = " AND ".join(f"(s.{v} IS NULL OR e.{v} <= s.{v})" for v in _LATENCY)
_MET_OR_NA = " AND ".join(f"(s.{v} IS NULL OR e.{v} IS NULL OR e.{v} <= s.{v})" for v in _LATENCY)
_COMPLIANT = f"""({_SUCCEEDED} AND NOT EXISTS (
    SELECT 1 FROM slo_slo s JOIN deployments_deployment d
         ON (d.id = s.deployment_id OR (s.scope = 'model' AND d.model_id = s.model_id))
    WHERE s.sli_kind IN ('latency', 'goodput') AND e.deployment = d.name AND (s.scope <> 'tenant' OR e.tenant = s.tenant)
      AND (CASE s.sli_kind WHEN 'latency' THEN {_SUCCEEDED} AND {_MEASURED} ELSE true END)
      AND NOT (CASE s.sli_kind WHEN 'latency' THEN {_MET} ELSE {_MET_OR_NA} END)))"""
_CLEAR = """
    DELETE FROM costing_usagehour u USING unnest(%(deployments)s::text[], %(hours)s::timestamptz[]) AS k(deployment, hour)
    WHERE u.deployment = k.deployment AND u.hour = k.hour
"""
_ROLLUP = f"""
    WITH k AS (SELECT * FROM unnest(%(deployments)s::text[], %(hours)s::timestamptz[]) AS k(deployment, hour)),
    minutes AS (
        SELECT k.hour, m.deployment, m.version, m.tenant, sum(m.requests) AS requests,
               sum(m.prompt_tokens) AS prompt_tokens, sum(m.completion_tokens) AS completion_tokens
        FROM k JOIN tenants_usageminute m ON m.deployment = k.deployment
             AND m.minute >= k.hour AND m.minute < k.hour + interval '1 hour'
        WHERE m.tenant IS NOT NULL AND m.version IS NOT NULL
        GROUP BY 1, 2, 3, 4
    ),
    compliant AS (
        SELECT k.hour, e.deployment, e.version, e.tenant, sum(e.prompt_tokens) AS prompt_tokens,
               sum(e.completion_tokens) AS completion_tokens
        FROM k JOIN tenants_usageevent e ON e.deployment = k.deployment
             AND e.time >= k.hour AND e.time < k.hour + interval '1 hour'
        WHERE e.tenant IS NOT NULL AND e.version IS NOT NULL AND {_COMPLIANT}
        GROUP BY 1, 2, 3, 4
    )
    INSERT INTO costing_usagehour (hour, deployment, version, tenant, requests, prompt_tokens, completion_tokens,
                                   compliant_prompt_tokens, compliant_completion_tokens, changed)
    SELECT m.hour, m.deployment, m.version, m.tenant, m.requests, m.prompt_tokens, m.completion_tokens,
           coalesce(c.prompt_tokens, 0), coalesce(c.completion_tokens, 0), true
    FROM minutes m LEFT JOIN compliant c USING (hour, deployment, version, tenant)
"""


def catch_up(apps, schema_editor):
    state = apps.get_model("costing", "LedgerState").objects.filter(pk=1).first()
    with schema_editor.connection.cursor() as cursor:
        if state is not None and state.usage_watermark is not None:
            cursor.execute(_TOUCHED, [state.usage_watermark])
        else:
            cursor.execute(_ALL_HOURS)
        keys = cursor.fetchall()
        if keys:
            params = {"deployments": [k[0] for k in keys], "hours": [k[1] for k in keys]}
            cursor.execute(_CLEAR, params)
            cursor.execute(_ROLLUP, params)


class Migration(migrations.Migration):

    dependencies = [
        ('costing', '0001_initial'),
        ('slo', '0005_minutes_from_the_usage_pipeline'),
        ('tenants', '0007_usageevent_client_request_id_ttft_source'),
    ]

    operations = [
        migrations.AddField(
            model_name='usagehour',
            name='changed',
            field=models.BooleanField(db_default=False, default=False),
        ),
        migrations.AddIndex(
            model_name='usagehour',
            index=models.Index(condition=models.Q(('changed', True)), fields=['hour'], name='usage_hour_changed'),
        ),
        migrations.RunPython(catch_up, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name='ledgerstate',
            name='usage_watermark',
        ),
    ]
