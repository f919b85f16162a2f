#!/usr/bin/env bash
# A local PostgreSQL server for clora-feedback's tests and single-machine deployments.
# Idempotent; meant for a fresh Debian/Ubuntu machine, run as root (or with sudo):
#   1. installs Debian's `postgresql` package when `pg_ctlcluster` is missing;
#   2. starts the cluster `pg_lsclusters` lists (the newest version's `main`);
#   3. waits until it accepts connections;
#   4. creates the role `clora` (password `clora`, LOGIN CREATEDB) and the database
#      `clora` when missing;
#   5. writes the URL to var/postgres.url (the test fixtures read it when
#      $CLORA_TEST_POSTGRES_URL is unset) and prints it.
#   --url   print only the URL on stdout (progress goes to stderr), for
#           `export CLORA_TEST_POSTGRES_URL=$(bash scripts/postgres.sh --url)`.
# Not here: production tuning, backups or remote access (listen_addresses stays loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
URL_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --url) URL_ONLY=1 ;;
    *) echo "usage: bash scripts/postgres.sh [--url]" >&2; exit 2 ;;
  esac
done
ROLE=clora
PASSWORD=clora
DATABASE=clora
PORT_DEFAULT=5432

say() { echo "postgres.sh: $*" >&2; }

# Root runs privileged steps directly; anyone else needs sudo for them.
as_root() {
  if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# The cluster's superuser is the OS user `postgres` (peer authentication on the socket).
as_postgres() {
  if [ "$(id -un)" = postgres ]; then
    "$@"
  elif [ "$(id -u)" = 0 ]; then
    # runuser keeps the argument vector intact (no shell re-quoting of the SQL).
    runuser -u postgres -- "$@"
  else
    sudo -u postgres -- "$@"
  fi
}

psql_admin() {
  as_postgres psql --no-psqlrc -v ON_ERROR_STOP=1 -p "$PORT" -tA "$@"
}

if ! command -v pg_ctlcluster >/dev/null 2>&1; then
  say "installing Debian's postgresql package"
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql >&2
fi

# `pg_lsclusters -h`: version cluster port status owner datadir logfile; newest version last.
CLUSTER_LINE=$(pg_lsclusters -h | awk '$2 == "main"' | sort -V | tail -n 1)
if [ -z "$CLUSTER_LINE" ]; then
  VERSION=$(ls /usr/lib/postgresql | sort -V | tail -n 1)
  say "creating cluster $VERSION/main"
  as_root pg_createcluster "$VERSION" main >&2
  CLUSTER_LINE=$(pg_lsclusters -h | awk '$2 == "main"' | sort -V | tail -n 1)
fi
VERSION=$(echo "$CLUSTER_LINE" | awk '{print $1}')
PORT=$(echo "$CLUSTER_LINE" | awk '{print $3}')
PORT=${PORT:-$PORT_DEFAULT}
STATUS=$(echo "$CLUSTER_LINE" | awk '{print $4}')
if [ "$STATUS" != online ]; then
  say "starting cluster $VERSION/main"
  as_root pg_ctlcluster "$VERSION" main start >&2
fi

# The first start after an install can take a few seconds before it accepts connections.
for _ in $(seq 1 60); do
  if pg_isready -q -h 127.0.0.1 -p "$PORT"; then break; fi
  sleep 1
done
if ! pg_isready -q -h 127.0.0.1 -p "$PORT"; then
  say "the cluster $VERSION/main does not accept connections on 127.0.0.1:$PORT" \
    "(see /var/log/postgresql/postgresql-$VERSION-main.log)"
  exit 1
fi

if [ "$(psql_admin -c "SELECT 1 FROM pg_roles WHERE rolname = '$ROLE'")" != 1 ]; then
  say "creating role $ROLE"
  psql_admin -c "CREATE ROLE $ROLE LOGIN CREATEDB PASSWORD '$PASSWORD'" >/dev/null
else
  # A role left by an older run keeps working with the documented password and rights.
  psql_admin -c "ALTER ROLE $ROLE LOGIN CREATEDB PASSWORD '$PASSWORD'" >/dev/null
fi
# The tests drop their databases WITH (FORCE), which signals the sessions on them.
psql_admin -c "GRANT pg_signal_backend TO $ROLE" >/dev/null
if [ "$(psql_admin -c "SELECT 1 FROM pg_database WHERE datname = '$DATABASE'")" != 1 ]; then
  say "creating database $DATABASE"
  psql_admin -c "CREATE DATABASE $DATABASE OWNER $ROLE" >/dev/null
fi

URL="postgresql://$ROLE:$PASSWORD@127.0.0.1:$PORT/$DATABASE"
mkdir -p var
echo "$URL" > var/postgres.url
if [ "$URL_ONLY" = 0 ]; then
  say "PostgreSQL $VERSION ready; URL written to var/postgres.url"
fi
echo "$URL"
