#!/usr/bin/env bash
# The servers the tests start (tests/servers.py): redis-server and PostgreSQL,
# from Debian's packages, installed only when missing (needs root and apt-get).
set -euo pipefail
have_pg() { ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null; }
if command -v redis-server >/dev/null && have_pg; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "redis-server and PostgreSQL are needed by tests/test_keys_shared.py: install them (Debian: redis-server postgresql)" >&2
  exit 0  # locally those tests skip; in CI they fail
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
apt-get install -y -q --no-install-recommends redis-server postgresql
