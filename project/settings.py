"""Django settings, all read from the environment in this one file.

Every variable has a row in docs/settings.md's Configuration table (tests/test_settings_doc.py fails
when a variable read here has none). Without DATABASE_URL / REDIS_URL they point at the
embedded Postgres and Redis under the data directory, which `inferops run` starts (see
project/embedded.py); importing this module starts nothing, so an image build can run
collectstatic without any server.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from inferops.env import ImproperlyConfiguredEnv, env_bool, env_float, env_int, env_list, env_str
from project import embedded

BASE_DIR = Path(__file__).resolve().parent.parent


def database_from_url(url: str) -> dict:
    """postgres://user:pass@host:port/name?sslmode=..; a Unix socket dir may be given
    percent-encoded as the host or as ?host=/path."""
    parsed = urlparse(url)
    if parsed.scheme not in {"postgres", "postgresql", "pgsql"}:
        raise ValueError(f"DATABASE_URL: unsupported scheme {parsed.scheme!r}; use postgres://")
    query = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    host = query.pop("host", None) or unquote(parsed.hostname or "")
    if parsed.netloc and "%2F" in parsed.netloc.upper():
        host = unquote(parsed.netloc.rsplit("@", 1)[-1])
    name = unquote(parsed.path.lstrip("/")) or "postgres"
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": name,
        "USER": unquote(parsed.username or "postgres"),
        "PASSWORD": unquote(parsed.password or ""),
        "HOST": host,
        "PORT": str(parsed.port or ""),
        "CONN_MAX_AGE": env_int("DATABASE_CONN_MAX_AGE", 0),
        "OPTIONS": {**query, "connect_timeout": env_int("DATABASE_CONNECT_TIMEOUT", 5)},
        # Named after the database, as Django does: checkouts testing against other databases of one
        # server do not share (and flush) one test database.
        "TEST": {"NAME": env_str("DATABASE_TEST_NAME", "test_inferops" if name == "postgres" else f"test_{name}")},
    }


# INFEROPS_PRODUCTION=1: the documented production environment (docs/operations.md, "Production
# settings"): SECRET_KEY required, and what `manage.py check --deploy` asks for on by default.
PRODUCTION = env_bool("INFEROPS_PRODUCTION", False)


def secret_key() -> str:
    """SECRET_KEY from the environment, else (not in production) one generated once and kept in the data dir."""
    key = env_str("SECRET_KEY")
    if PRODUCTION and (not key or len(key) < 50 or len(set(key)) < 5):
        raise ImproperlyConfiguredEnv(
            "INFEROPS_PRODUCTION=1 needs SECRET_KEY: at least 50 random characters, the same in every "
            "process of the installation (python -c 'import secrets; print(secrets.token_urlsafe(50))')")
    if key:
        return key
    path = embedded.data_dir() / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


DEBUG = env_bool("DEBUG", False)
SECRET_KEY = secret_key()
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["127.0.0.1", "localhost", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])
# HTTPS: cookies only over it, HSTS, plain HTTP redirected (but health probes and Prometheus, which
# speak plain HTTP inside a cluster). Behind a proxy that terminates TLS and sets X-Forwarded-Proto
# (and drops a client's own), INFEROPS_BEHIND_TLS_PROXY=1 makes Django believe that header.
SESSION_COOKIE_SECURE = env_bool("SESSION_COOKIE_SECURE", PRODUCTION)
CSRF_COOKIE_SECURE = env_bool("CSRF_COOKIE_SECURE", PRODUCTION)
SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", PRODUCTION)
# Probes, Prometheus and the gateway's forwarded /v1/files and /v1/batches (gateway to web inside the
# cluster; clients meet TLS at the gateway's own ingress) stay on plain HTTP.
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$", r"^v1/"]
SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 365 * 86400 if PRODUCTION else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", PRODUCTION)
SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", False)
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if env_bool("INFEROPS_BEHIND_TLS_PROXY", False) else None
# Proxies in front of the web app that append to X-Forwarded-For: the client address of login rate
# limiting is the one the outermost saw (inferops/login_limits.py).
INFEROPS_TRUSTED_PROXIES = env_int("INFEROPS_TRUSTED_PROXIES", 0)
# Failed sign-ins allowed per account and per client address within the lockout window.
INFEROPS_LOGIN_MAX_FAILURES_PER_ACCOUNT = env_int("INFEROPS_LOGIN_MAX_FAILURES_PER_ACCOUNT", 5)
INFEROPS_LOGIN_MAX_FAILURES_PER_ADDRESS = env_int("INFEROPS_LOGIN_MAX_FAILURES_PER_ADDRESS", 20)
INFEROPS_LOGIN_LOCKOUT_S = env_int("INFEROPS_LOGIN_LOCKOUT_S", 900)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "django.contrib.postgres",
    "inferops",
    "registry",
    "deployments",
    "evals",
    "tenants",
    "slo",
    "alerts",
    "costing",
    "degradation",
    "batches",
    "capacity",
    # The wiring: it holds the `bootstrap` management command.
    "project",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "inferops.middleware.ContentSecurityPolicyMiddleware",
    "inferops.middleware.BodySizeLimitMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "inferops.middleware.ConsoleRoleMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "inferops.middleware.DatabaseUnavailableMiddleware",
]

ROOT_URLCONF = "project.urls"
ASGI_APPLICATION = "project.asgi.application"
WSGI_APPLICATION = "project.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "inferops.context_processors.roles",
                "inferops.context_processors.csp_nonce",
            ],
        },
    },
]

DATABASES = {"default": database_from_url(env_str("DATABASE_URL") or embedded.database_url())}
REDIS_URL = env_str("REDIS_URL") or embedded.redis_url()

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
    }
}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = embedded.data_dir() / "static"
STATIC_ROOT.mkdir(exist_ok=True)
# plotly.js with only the trace types the console draws, from npm (package.json; `make install`,
# platform/Dockerfile); inferops.assets falls back to the plotly package's full bundle without it.
PLOTLY_PARTIAL_BUNDLE = BASE_DIR / "node_modules" / "plotly.js-basic-dist-min" / "plotly-basic.min.js"


def batch_files_storage(url: str) -> dict:
    """Where batch input, output and error files live: a local folder (the default, under the data
    directory), or an S3-compatible bucket, `s3://bucket/optional/prefix` (credentials from AWS's
    usual variables; INFEROPS_S3_ENDPOINT_URL for MinIO, R2, Ceph and the like)."""
    if not url:
        return {"BACKEND": "django.core.files.storage.FileSystemStorage",
                "OPTIONS": {"location": embedded.data_dir() / "batch-files"}}
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ImproperlyConfiguredEnv(f"INFEROPS_BATCH_FILES_URL={url!r}: expected s3://bucket[/prefix] (or unset "
                                      "for a folder in the data directory)")
    return {"BACKEND": "storages.backends.s3.S3Storage",
            "OPTIONS": {"bucket_name": parsed.netloc, "location": parsed.path.strip("/"),
                        "endpoint_url": env_str("INFEROPS_S3_ENDPOINT_URL") or None, "file_overwrite": False}}


STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
    "batch_files": batch_files_storage(env_str("INFEROPS_BATCH_FILES_URL")),
}
WHITENOISE_USE_FINDERS = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
# Registration bodies are small JSON; anything bigger is a mistake or an attack.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("INFEROPS_MAX_BODY_BYTES", 1024 * 1024)
# An eval set version (evals/sets/): its JSONL upload's bytes and cases at most. Its upload URLs
# take a body that large (and a multipart envelope within the limit above).
INFEROPS_EVALSET_MAX_BYTES = env_int("INFEROPS_EVALSET_MAX_BYTES", 5 * 1024 * 1024)
INFEROPS_EVALSET_MAX_CASES = env_int("INFEROPS_EVALSET_MAX_CASES", 10_000)
# Batches (batches/): an input file's bytes and requests at most (OpenAI's limits), how long a
# runner may go without a heartbeat before the beat resumes its batch elsewhere, a line's time limit,
# and how many lines one replica may have in flight at most (the runner's window grows up to it).
INFEROPS_BATCH_MAX_FILE_BYTES = env_int("INFEROPS_BATCH_MAX_FILE_BYTES", 200 * 1000 * 1000)
INFEROPS_BATCH_MAX_LINES = env_int("INFEROPS_BATCH_MAX_LINES", 50_000)
INFEROPS_BATCH_STALE_S = env_float("INFEROPS_BATCH_STALE_S", 60)
INFEROPS_BATCH_REQUEST_TIMEOUT_S = env_float("INFEROPS_BATCH_REQUEST_TIMEOUT_S", 600)
INFEROPS_BATCH_MAX_INFLIGHT_PER_REPLICA = env_int("INFEROPS_BATCH_MAX_INFLIGHT_PER_REPLICA", 32)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["inferops.permissions.RolePermission"],
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "inferops.api.exception_handler",
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
}
SPECTACULAR_SETTINGS = {
    "TITLE": "inferops API",
    "DESCRIPTION": "REST API for CI pipelines and operators: model registry and audit log.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "COMPONENT_SPLIT_REQUEST": True,
    # Served from the package, not a CDN: the console works on machines without internet.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # Several serializers have a "status" field; these name their enums after what they mean.
    "ENUM_NAME_OVERRIDES": {"SloStateEnum": "slo.choices.SloState",
                            "RolloutStatusEnum": "deployments.choices.RolloutStatus"},
}

CELERY_BROKER_URL = REDIS_URL.replace("unix://", "redis+socket://", 1)
CELERY_RESULT_BACKEND = None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TIMEZONE = "UTC"
# A batch's runner holds its worker slot for as long as the batch runs (hours): it gets a queue of its
# own, which a worker of its own consumes (`celery worker -Q batches`; `inferops run`, compose and the
# Kubernetes manifests start one), so batches never take the slots reconcile, ingestion and SLOs need.
# A capacity run (minutes of stepped load against one replica) holds its slot the same way, so it goes there too.
CELERY_TASK_ROUTES = {"batches.run_batch": {"queue": "batches"},
                      "capacity.execute_capacity_run": {"queue": "batches"}}
# The whole beat schedule, one place; later issues add their periodic tasks here.
CELERY_BEAT_SCHEDULE: dict[str, dict] = {
    "heartbeat": {
        "task": "inferops.tasks.heartbeat",
        "schedule": env_float("INFEROPS_HEARTBEAT_S", 30),
        "options": {"expires": 25},
    },
}

# Deployments: replicas and their drivers.
INFEROPS_DATA_DIR = embedded.data_dir()
INFEROPS_NODE_NAME = env_str("INFEROPS_NODE_NAME")  # default: the host name
# The address local replicas bind to and publish in their URL; the gateway and the scraper must
# reach it (docker-compose sets the worker container's name).
INFEROPS_ADVERTISE_ADDRESS = env_str("INFEROPS_ADVERTISE_ADDRESS", "127.0.0.1")
# Worker variables a local replica inherits beyond what a model server needs (deployments/replicas/drivers/local.py).
INFEROPS_REPLICA_ENV = env_str("INFEROPS_REPLICA_ENV")
INFEROPS_VLLM_PYTHON = env_str("INFEROPS_VLLM_PYTHON")  # a Python with vLLM installed
# LD_PRELOAD for vLLM replicas the local driver starts: "auto" = what vLLM's CPU guide asks for
# when INFEROPS_VLLM_PYTHON is a CPU build (runtime.vllm_preload.vllm_cpu_preload), "none", or
# a value to use as it is. An LD_PRELOAD already in the worker's environment always wins.
INFEROPS_VLLM_LD_PRELOAD = env_str("INFEROPS_VLLM_LD_PRELOAD", "auto")
INFEROPS_RECONCILE_INTERVAL_S = env_float("INFEROPS_RECONCILE_INTERVAL_S", 2)
INFEROPS_K8S_NAMESPACE = env_str("INFEROPS_K8S_NAMESPACE", "inferops")
# During the watch after a rollout, the percent of traffic kept on the previous version so the new
# one is judged against it at the same time (a rollout's `holdback` overrides it; 0: none).
INFEROPS_ROLLOUT_HOLDBACK_PERCENT = env_int("INFEROPS_ROLLOUT_HOLDBACK_PERCENT", 5)
if not 0 <= INFEROPS_ROLLOUT_HOLDBACK_PERCENT <= 50:
    raise ImproperlyConfiguredEnv(
        f"INFEROPS_ROLLOUT_HOLDBACK_PERCENT={INFEROPS_ROLLOUT_HOLDBACK_PERCENT}: expected a percent from 0 to 50")
CELERY_BEAT_SCHEDULE["reconcile-replicas"] = {
    "task": "deployments.reconcile_all",
    "schedule": INFEROPS_RECONCILE_INTERVAL_S,
    "options": {"expires": INFEROPS_RECONCILE_INTERVAL_S},
}

# Replica metrics retention (deployments/replicas/retention.py prunes older rows).
INFEROPS_METRICS_MINUTE_RETENTION_DAYS = env_int("INFEROPS_METRICS_MINUTE_RETENTION_DAYS", 14)
INFEROPS_METRICS_HOUR_RETENTION_DAYS = env_int("INFEROPS_METRICS_HOUR_RETENTION_DAYS", 400)
INFEROPS_SCRAPE_INTERVAL_S = env_float("INFEROPS_SCRAPE_INTERVAL_S", 15)
CELERY_BEAT_SCHEDULE |= {
    "scrape-replicas": {
        "task": "deployments.scrape_replicas",
        "schedule": INFEROPS_SCRAPE_INTERVAL_S,
        "options": {"expires": INFEROPS_SCRAPE_INTERVAL_S},
    },
    "rollup-metrics": {"task": "deployments.rollup_metrics", "schedule": 300.0, "options": {"expires": 290}},
    "prune-metrics": {"task": "deployments.prune_metrics", "schedule": 3600.0, "options": {"expires": 3500}},
}

# SLOs and alerts (slo/, alerts/): evaluation every minute; webhook deliveries retry temporary
# errors with exponential backoff; INFEROPS_EXTERNAL_URL is where alert links point.
INFEROPS_EXTERNAL_URL = env_str("INFEROPS_EXTERNAL_URL", "http://127.0.0.1:8000")
INFEROPS_SLO_EVALUATE_INTERVAL_S = env_float("INFEROPS_SLO_EVALUATE_INTERVAL_S", 60)
INFEROPS_WEBHOOK_TIMEOUT_S = env_float("INFEROPS_WEBHOOK_TIMEOUT_S", 10)
INFEROPS_WEBHOOK_MAX_ATTEMPTS = env_int("INFEROPS_WEBHOOK_MAX_ATTEMPTS", 6)
INFEROPS_WEBHOOK_BACKOFF_S = env_float("INFEROPS_WEBHOOK_BACKOFF_S", 5)
# How long the acknowledgement link in a notification works.
INFEROPS_ACK_LINK_MAX_AGE_S = env_int("INFEROPS_ACK_LINK_MAX_AGE_S", 86400)
# Email receivers go through Django's email backend (SMTP unless EMAIL_BACKEND says otherwise).
EMAIL_BACKEND = env_str("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend")
EMAIL_HOST = env_str("EMAIL_HOST", "localhost")
EMAIL_PORT = env_int("EMAIL_PORT", 25)
EMAIL_HOST_USER = env_str("EMAIL_HOST_USER")
EMAIL_HOST_PASSWORD = env_str("EMAIL_HOST_PASSWORD")
EMAIL_USE_TLS = env_bool("EMAIL_USE_TLS", False)
EMAIL_USE_SSL = env_bool("EMAIL_USE_SSL", False)
EMAIL_TIMEOUT = env_float("EMAIL_TIMEOUT", 10)
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "inferops@localhost")
# The default route's grouping (alerts/routing/dispatch.py), as Alertmanager's defaults; routes may override
# each. The beat moves groups on every INFEROPS_ALERT_TICK_S: a group is notified within
# group_wait plus one tick.
INFEROPS_ALERT_GROUP_BY = env_list("INFEROPS_ALERT_GROUP_BY", ["alertname", "slo", "deployment"])
INFEROPS_ALERT_GROUP_WAIT_S = env_int("INFEROPS_ALERT_GROUP_WAIT_S", 30)
INFEROPS_ALERT_GROUP_INTERVAL_S = env_int("INFEROPS_ALERT_GROUP_INTERVAL_S", 300)
INFEROPS_ALERT_REPEAT_INTERVAL_S = env_int("INFEROPS_ALERT_REPEAT_INTERVAL_S", 4 * 3600)
INFEROPS_ALERT_TICK_S = env_float("INFEROPS_ALERT_TICK_S", 5)
CELERY_BEAT_SCHEDULE["advance-alert-groups"] = {
    "task": "alerts.advance_groups", "schedule": INFEROPS_ALERT_TICK_S,
    "options": {"expires": INFEROPS_ALERT_TICK_S * 0.9},
}
CELERY_BEAT_SCHEDULE["notify-unmuted-alerts"] = {
    "task": "alerts.notify_unmuted", "schedule": 30.0, "options": {"expires": 29},
}
CELERY_BEAT_SCHEDULE["evaluate-slos"] = {
    "task": "slo.evaluate_slos",
    "schedule": INFEROPS_SLO_EVALUATE_INTERVAL_S,
    "options": {"expires": INFEROPS_SLO_EVALUATE_INTERVAL_S * 0.9},
}
# SLO minute rows outlive the longest window (31 days) plus the 3-day burn window.
INFEROPS_SLO_MINUTE_RETENTION_DAYS = env_int("INFEROPS_SLO_MINUTE_RETENTION_DAYS", 40)
CELERY_BEAT_SCHEDULE["prune-slo-minutes"] = {
    "task": "slo.prune_minutes", "schedule": 3600.0, "options": {"expires": 3500},
}
# Latency targets to built-in replicas and gateways (slo/engine_targets.py): right after an SLO write,
# and every tick, so a new replica has its deployment's targets within one.
INFEROPS_SLO_TARGETS_INTERVAL_S = env_float("INFEROPS_SLO_TARGETS_INTERVAL_S", 15)
CELERY_BEAT_SCHEDULE["sync-engine-targets"] = {
    "task": "slo.sync_engine_targets", "schedule": INFEROPS_SLO_TARGETS_INTERVAL_S,
    "options": {"expires": INFEROPS_SLO_TARGETS_INTERVAL_S * 0.9},
}
# Quality SLOs: each tick starts the eval runs that are due (slo/quality.py).
CELERY_BEAT_SCHEDULE["start-quality-runs"] = {
    "task": "slo.start_quality_runs", "schedule": 60.0, "options": {"expires": 55},
}

# Tenants, API keys and the usage ledger (tenants/): keys republished every 30 s so a flushed
# Redis heals; usage ingested every 2 s (each run drains the backlog for up to
# INFEROPS_USAGE_INGEST_BUDGET_S); raw usage events pruned after their retention. The two
# intervals are settings so that tests can shorten them.
INFEROPS_USAGE_EVENT_RETENTION_DAYS = env_int("INFEROPS_USAGE_EVENT_RETENTION_DAYS", 35)
INFEROPS_USAGE_INGEST_BUDGET_S = env_float("INFEROPS_USAGE_INGEST_BUDGET_S", 5)
INFEROPS_USAGE_INGEST_INTERVAL_S = env_float("INFEROPS_USAGE_INGEST_INTERVAL_S", 2)
INFEROPS_KEYS_PUBLISH_INTERVAL_S = env_float("INFEROPS_KEYS_PUBLISH_INTERVAL_S", 30)
CELERY_BEAT_SCHEDULE |= {
    "publish-keys": {"task": "tenants.publish_keys", "schedule": INFEROPS_KEYS_PUBLISH_INTERVAL_S,
                     "options": {"expires": INFEROPS_KEYS_PUBLISH_INTERVAL_S * 0.9}},
    "ingest-usage": {"task": "tenants.ingest_usage", "schedule": INFEROPS_USAGE_INGEST_INTERVAL_S,
                     "options": {"expires": INFEROPS_USAGE_INGEST_INTERVAL_S}},
    "prune-usage-events": {"task": "tenants.prune_usage_events", "schedule": 3600.0, "options": {"expires": 3500}},
}

# Costing (costing/): the ledger every minute (at most two minutes behind), budgets every 5 minutes,
# month close looked for hourly. Decode tokens weigh 4x prefill tokens in the allocation to
# tenants (docs/costs.md). INFEROPS_COST_LOCAL_CPUS: cores a local replica without cpu_threads
# or resources.cpu is charged for (default: this host's).
INFEROPS_COST_TIER = env_str("INFEROPS_COST_TIER", "on-demand")
INFEROPS_COST_LOCAL_CPUS = env_int("INFEROPS_COST_LOCAL_CPUS", 0)
INFEROPS_COST_PROMPT_WEIGHT = env_float("INFEROPS_COST_PROMPT_WEIGHT", 1)
INFEROPS_COST_COMPLETION_WEIGHT = env_float("INFEROPS_COST_COMPLETION_WEIGHT", 4)
INFEROPS_COST_FORECAST_MIN_HOURS = env_float("INFEROPS_COST_FORECAST_MIN_HOURS", 24)
CELERY_BEAT_SCHEDULE |= {
    "sync-cost-ledger": {"task": "costing.sync_ledger", "schedule": 60.0, "options": {"expires": 55}},
    "evaluate-cost-budgets": {"task": "costing.evaluate_budgets", "schedule": 300.0, "options": {"expires": 290}},
    "close-cost-months": {"task": "costing.close_months", "schedule": 3600.0, "options": {"expires": 3500}},
}
# Eval runs (evals/runs/runner.py): a running run whose worker stopped beating is failed.
CELERY_BEAT_SCHEDULE["reap-eval-runs"] = {"task": "evals.reap_runs", "schedule": 60.0, "options": {"expires": 55}}
INFEROPS_BATCH_TICK_S = env_float("INFEROPS_BATCH_TICK_S", 15)
# Elastic capacity (capacity/): an autoscaling tick per autoscaled deployment every
# INFEROPS_AUTOSCALE_INTERVAL_S; requests held for parked deployments looked for every INFEROPS_WAKE_POLL_S.
INFEROPS_AUTOSCALE_INTERVAL_S = env_float("INFEROPS_AUTOSCALE_INTERVAL_S", 5)
INFEROPS_WAKE_POLL_S = env_float("INFEROPS_WAKE_POLL_S", 1)
CELERY_BEAT_SCHEDULE |= {
    "autoscale": {"task": "capacity.autoscale_all", "schedule": INFEROPS_AUTOSCALE_INTERVAL_S,
                  "options": {"expires": INFEROPS_AUTOSCALE_INTERVAL_S}},
    "wake-parked": {"task": "capacity.wake_requested", "schedule": INFEROPS_WAKE_POLL_S,
                    "options": {"expires": INFEROPS_WAKE_POLL_S}},
}
CELERY_BEAT_SCHEDULE["resume-batches"] = {"task": "batches.tick", "schedule": INFEROPS_BATCH_TICK_S,
                                          "options": {"expires": INFEROPS_BATCH_TICK_S * 0.9}}

# INFEROPS_LOG_FORMAT=json: one JSON object a line, the gateway's and the replicas' format too;
# Celery then keeps Django's handler instead of installing its own plain one.
LOG_JSON = env_str("INFEROPS_LOG_FORMAT", "").lower() == "json"
CELERY_WORKER_HIJACK_ROOT_LOGGER = not LOG_JSON
LOG_LEVEL = env_str("INFEROPS_LOG_LEVEL", "INFO").upper()
# Celery logs each task "received" and "succeeded" at INFO and beat each "Sending due task": with
# tasks every 2 s that is most of a day's log. They show at INFEROPS_LOG_LEVEL=DEBUG; a failed task
# is an ERROR and always shows.
TASK_LOG_LEVEL = "DEBUG" if LOG_LEVEL == "DEBUG" else "WARNING"
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"},
                   "json": {"()": "runtime.gateway.jsonlog.JsonFormatter"}},
    "filters": {"refusal_without_traceback": {"()": "inferops.logfilters.RefusalWithoutTraceback"}},
    "handlers": {"console": {"class": "logging.StreamHandler",
                             "formatter": "json" if LOG_JSON else "plain"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {
        # One INFO line per HTTP request (health checks, scrapes) would drown everything else.
        "httpx": {"level": "WARNING"}, "httpcore": {"level": "WARNING"},
        "celery.worker.strategy": {"level": TASK_LOG_LEVEL}, "celery.app.trace": {"level": TASK_LOG_LEVEL},
        "celery.beat": {"level": TASK_LOG_LEVEL},
        "django.request": {"filters": ["refusal_without_traceback"]},
    },
}
