#!/usr/bin/env bash
# expertrail's two entry points, each self-installing on a fresh machine:
#   ./run.sh bench [expertrail bench options]   the main job: every dispatcher on 4 local CPU ranks
#   ./run.sh test  [pytest options]             the whole test suite
# Both create ./.venv (or $EXPERTRAIL_VENV) with CPU PyTorch 2.13.0 and expertrail on first use.
set -euo pipefail
cd "$(dirname "$0")"
venv=${EXPERTRAIL_VENV:-.venv}
stamp="$venv/.expertrail-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check torch==2.13.0   # CPU build, before anything asks for torch
  "$venv/bin/pip" install -q --disable-pip-version-check -e ".[test]"
  touch "$stamp"
fi
cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  bench) exec "$venv/bin/expertrail" bench "$@" ;;
  test)
    # The emulated-cluster tests apply packet loss with nftables: install it where we may.
    if [ "$(id -u)" = 0 ] && ! command -v nft >/dev/null && command -v apt-get >/dev/null; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables) >/dev/null 2>&1 \
        || echo "run.sh: nftables could not be installed; the packet-loss test will skip" >&2
    fi
    # Bytecode for the package and the test helpers, written once: the suite starts hundreds of
    # rank processes, and where the environment sets PYTHONDONTWRITEBYTECODE each would compile
    # them again (about 12% of a multi-rank test file's time).
    "$venv/bin/python" -m compileall -q src tests >/dev/null 2>&1 || true
    set +e
    "$venv/bin/python" -m pytest "$@"
    rc=$?
    [ $rc -eq 5 ] && echo "no tests ran" >&2 && rc=1
    exit $rc ;;
  *) echo "usage: ./run.sh bench [options] | ./run.sh test [pytest options]" >&2; exit 2 ;;
esac
