import logging
import time

from celery import shared_task

from inferops import health
from inferops.models import installation_id

log = logging.getLogger(__name__)


@shared_task(name="inferops.tasks.heartbeat")
def heartbeat() -> float:
    """Beat -> worker round trip; the console shows the last one to say the workers live.

    It also renews this installation's claim on the Redis database, and says loudly when
    another installation's workers use the same one."""
    now = time.time()
    health.record_worker_heartbeat(now)
    if other := health.claim_redis(installation_id()):
        log.error("This Redis database (REDIS_URL) is also used by inferops installation %s: the two share "
                  "Celery's queues and the gateway's routes. Give each installation its own Redis database.",
                  other)
    return now
