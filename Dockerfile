# syntax=docker/dockerfile:1
#
# One image for every process of the pipeline (receiver, worker, sweep, flower,
# migrate); docker-compose.yml picks the process with `command:`.
#
#   docker build -t stripe-ledger:local .
#   docker run --rm --env-file .env stripe-ledger:local ledgerctl migrate
#
# Only the files the package needs are copied, so a local .env, .git or
# .devstack/ never ends up in an image layer.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Fixed, unprivileged uid/gid (no login shell, no sudo).
RUN groupadd --system --gid 10001 app \
 && useradd --system --uid 10001 --gid app --home-dir /app --no-create-home \
            --shell /usr/sbin/nologin app

# Install the project (a regular, non-editable install) with the ops extra (flower).
# psycopg[binary] ships libpq in its wheel, so no apt packages are needed.
# The sources are removed afterwards: at run time everything is imported from
# site-packages, which is exactly what `pip install .` put there (including the
# package data: SQL migrations).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ingest/ ingest/
COPY ledger/ ledger/
COPY workers/ workers/
COPY ops/ ops/
# hadolint ignore=DL3003,DL3013
RUN pip install ".[ops]" \
 && cd / && rm -rf /src \
 && ledgerctl --help >/dev/null

WORKDIR /app
RUN chown app:app /app
# Numeric, so orchestrators can verify runAsNonRoot without reading /etc/passwd.
USER 10001:10001

EXPOSE 8000 5555

# The receiver by default; compose overrides this per service.
CMD ["gunicorn", "--bind", "0.0.0.0:8000", "--workers", "2", "--worker-class", "gthread", "--threads", "16", "ingest.app:create_app()"]
