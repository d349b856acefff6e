"""Costing's side of the usage pipeline (inferops/usage_pipeline.py): hourly usage per tenant.

In the ingest transaction of a batch, the new events are added into `UsageHour` by hour ×
deployment × version × tenant: requests, tokens, the tokens of SLO-compliant requests, as the SLO
fold judged each event (`slo_compliant`; without any SLO app, a request that succeeded), and the
tokens of lines of offline batches (`batch_id` set), which the report charges at the batch price.
Rows are marked `changed`; the ledger sync claims the marks to know which hours late usage
reached (closed months get adjustments).
"""

from __future__ import annotations

_ADD_HOURS = """
    INSERT INTO costing_usagehour AS u (hour, deployment, version, tenant, requests, prompt_tokens, completion_tokens,
                                   compliant_prompt_tokens, compliant_completion_tokens, batch_prompt_tokens,
                                   batch_completion_tokens, changed)
    SELECT to_timestamp(hour), deployment, version, tenant, requests, prompt, completion, compliant_prompt,
           compliant_completion, batch_prompt, batch_completion, true
    FROM unnest(%b::float8[], %b::varchar[], %b::int8[], %b::varchar[], %b::int8[], %b::int8[], %b::int8[],
                %b::int8[], %b::int8[], %b::int8[], %b::int8[])
         AS batch(hour, deployment, version, tenant, requests, prompt, completion, compliant_prompt,
                  compliant_completion, batch_prompt, batch_completion)
    ON CONFLICT ON CONSTRAINT one_usage_hour DO UPDATE SET
        requests = u.requests + EXCLUDED.requests,
        prompt_tokens = u.prompt_tokens + EXCLUDED.prompt_tokens,
        completion_tokens = u.completion_tokens + EXCLUDED.completion_tokens,
        compliant_prompt_tokens = u.compliant_prompt_tokens + EXCLUDED.compliant_prompt_tokens,
        compliant_completion_tokens = u.compliant_completion_tokens + EXCLUDED.compliant_completion_tokens,
        batch_prompt_tokens = u.batch_prompt_tokens + EXCLUDED.batch_prompt_tokens,
        batch_completion_tokens = u.batch_completion_tokens + EXCLUDED.batch_completion_tokens,
        changed = true
"""


def fold_events(cursor, events: list[dict]) -> None:
    """Add the batch's new events into the hourly usage rows (see above)."""
    hours: dict[tuple, list[int]] = {}
    for event in events:
        deployment, version, tenant = event["deployment"], event["version"], event["tenant"]
        if deployment is None or version is None or tenant is None:
            continue  # no tenant or version to allocate to (the report's rows need both)
        key = (event["time"] // 3600 * 3600, deployment, version, tenant)
        sums = hours.get(key)
        if sums is None:
            sums = hours[key] = [0, 0, 0, 0, 0, 0, 0]
        prompt, completion = event["prompt_tokens"], event["completion_tokens"]
        sums[0] += 1
        sums[1] += prompt
        sums[2] += completion
        compliant = event.get("slo_compliant")
        if compliant is None:
            compliant = event["status"] < 400 and event["error_kind"] is None
        if compliant:
            sums[3] += prompt
            sums[4] += completion
        if event.get("batch_id") is not None:  # .get: events built by hand may lack the field
            sums[5] += prompt
            sums[6] += completion
    if hours:
        keys = sorted(hours)  # one lock order for concurrent batches
        columns = [[key[i] for key in keys] for i in range(4)]
        columns += [[hours[key][i] for key in keys] for i in range(7)]
        cursor.execute(_ADD_HOURS, columns)
