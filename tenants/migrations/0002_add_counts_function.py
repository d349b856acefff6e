from django.db import migrations

# Adds two {label: count} JSON objects key by key; the usage ingestion merges latency histograms
# of a ledger row with it inside INSERT ... ON CONFLICT DO UPDATE.
ADD_COUNTS = """
CREATE OR REPLACE FUNCTION tenants_add_counts(a jsonb, b jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
  SELECT coalesce(jsonb_object_agg(label, total), '{}'::jsonb)
  FROM (
    SELECT label, sum(count::bigint) AS total
    FROM (
      SELECT key AS label, value AS count FROM jsonb_each_text(coalesce(a, '{}'::jsonb))
      UNION ALL
      SELECT key, value FROM jsonb_each_text(coalesce(b, '{}'::jsonb))
    ) AS pairs
    GROUP BY label
  ) AS sums
$$;
"""


class Migration(migrations.Migration):
    dependencies = [("tenants", "0001_initial")]

    operations = [
        migrations.RunSQL(ADD_COUNTS, reverse_sql="DROP FUNCTION IF EXISTS tenants_add_counts(jsonb, jsonb);"),
    ]
