#!/usr/bin/env bash
# Start a local Ray head (token authentication on, dashboard on 127.0.0.1) and an MLflow tracking
# server (sqlite backend, artifacts served over HTTP, bound to 127.0.0.1, HTTP basic authentication on:
# MLflow's basic-auth app with one admin user whose random password is kept in the run directory,
# mode 600; other users get no permission unless the admin grants it). Idempotent: a service
# already running from this run directory is left alone. Waits until both answer.
#
#   eval "$(bash infra/local/up.sh)"     # stdout is only `export ...` lines; progress goes to stderr
#   source runs/local/env.sh             # the same exports, written by this script
#
# Settings (environment):
#   FOVEATE_RUN_DIR         run directory for PIDs, logs, token, MLflow data   (default ./runs/local)
#   FOVEATE_RAY_PORT        GCS port of the head                                (default 6379)
#   FOVEATE_DASHBOARD_PORT  dashboard / job submission port                     (default 8265)
#   FOVEATE_MLFLOW_PORT     MLflow server port                                  (default 5000)
#   FOVEATE_RAY_CLIENT_PORT Ray client server port                              (default 10001)
#   FOVEATE_AGENT_PORT      dashboard agent HTTP port                           (default 52365)
#   FOVEATE_RAY_NUM_CPUS    CPUs the head advertises                            (default: all)
#   FOVEATE_RAY_RESOURCES   custom resources of the head, JSON, e.g. '{"head": 1}' (default: none)
#   FOVEATE_RAY_TEMP_DIR    Ray's temp dir (keep it short: unix socket paths)   (default /tmp/foveate-ray-<hash of run dir>)
#   FOVEATE_UP_TIMEOUT      seconds to wait for each service                    (default 120)
#   PYTHON                  interpreter whose environment has ray and mlflow    (default ./.venv/bin/python, else python3)
set -euo pipefail
# Everything this script and the services it starts create is owner-only: the tokens and passwords, MLflow's
# tracking and user databases (mlflow.db, basic_auth.db), artifacts, logs and Ray's session files.
umask 077

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
RUN_DIR=${FOVEATE_RUN_DIR:-$ROOT/runs/local}
mkdir -p "$RUN_DIR"
RUN_DIR=$(cd "$RUN_DIR" && pwd)
RAY_PORT=${FOVEATE_RAY_PORT:-6379}
DASHBOARD_PORT=${FOVEATE_DASHBOARD_PORT:-8265}
MLFLOW_PORT=${FOVEATE_MLFLOW_PORT:-5000}
TIMEOUT=${FOVEATE_UP_TIMEOUT:-120}
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$ROOT/.venv/bin/python" ]; then PY=$ROOT/.venv/bin/python
else PY=$(command -v python3); fi
BIN=$(dirname "$PY")
RAY_TMP=${FOVEATE_RAY_TEMP_DIR:-/tmp/foveate-ray-$(printf '%s' "$RUN_DIR" | cksum | cut -d' ' -f1)}

LOGS=$RUN_DIR/logs
TOKEN_FILE=$RUN_DIR/ray_auth_token
mkdir -p "$LOGS" "$RUN_DIR/mlflow/artifacts"
# a run directory made before the umask above: closed now (its databases and artifacts with it)
chmod 700 "$RUN_DIR" "$RUN_DIR/mlflow" "$RUN_DIR/mlflow/artifacts" "$LOGS"
for f in "$RUN_DIR/mlflow/mlflow.db" "$RUN_DIR/mlflow/basic_auth.db"; do [ -e "$f" ] && chmod 600 "$f"; done
say() { echo "up.sh: $*" >&2; }
# Each service is started with setsid: the PID in its pid file is the session id of every process it spawns.
# A session is running while it has a process that is not a zombie.
alive() { [ -f "$1" ] && ps -o stat= -s "$(cat "$1")" 2>/dev/null | grep -qv '^Z'; }

# ---------------------------------------------------------------- Ray token authentication
# Ray 2.60 reads the token from RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token,
# and checks it when RAY_AUTH_MODE=token. We keep our own token in the run directory (mode 600) and point
# every process (head, workers, job drivers, `ray job submit`) at it.
if [ ! -s "$TOKEN_FILE" ]; then
  (umask 077; "$PY" -c 'import secrets; print(secrets.token_hex(32), end="")' > "$TOKEN_FILE")
  say "generated Ray auth token in $TOKEN_FILE"
fi
chmod 600 "$TOKEN_FILE"
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN_FILE RAY_USAGE_STATS_ENABLED=0
unset RAY_AUTH_TOKEN RAY_ADDRESS
MLFLOW_URI=http://127.0.0.1:$MLFLOW_PORT
DASHBOARD_URL=http://127.0.0.1:$DASHBOARD_PORT

# ---------------------------------------------------------------- MLflow authentication
# MLflow's basic-auth app (`mlflow server --app-name basic-auth`, needs Flask-WTF: `mlflow[auth]`) reads its
# settings from MLFLOW_AUTH_CONFIG_PATH; on first start it creates the admin user with admin_password.
# Clients authenticate with MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (exported below; jobs
# inherit them from the head).
MLFLOW_USER=foveate
MLFLOW_PASSWORD_FILE=$RUN_DIR/mlflow_password
MLFLOW_AUTH_INI=$RUN_DIR/mlflow/basic_auth.ini
if ! "$PY" -c 'import flask_wtf' 2>/dev/null; then
  say "MLflow authentication needs Flask-WTF in $PY's environment: pip install 'mlflow[auth]' (or reinstall foveate)"
  exit 1
fi
if [ ! -s "$MLFLOW_PASSWORD_FILE" ]; then
  (umask 077; "$PY" -c 'import secrets; print(secrets.token_urlsafe(24), end="")' > "$MLFLOW_PASSWORD_FILE")
  say "generated the MLflow admin password in $MLFLOW_PASSWORD_FILE (user $MLFLOW_USER)"
fi
chmod 600 "$MLFLOW_PASSWORD_FILE"
SECRET_FILE=$RUN_DIR/mlflow_secret_key  # the auth app's CSRF key (MLFLOW_FLASK_SERVER_SECRET_KEY); server only
if [ ! -s "$SECRET_FILE" ]; then
  (umask 077; "$PY" -c 'import secrets; print(secrets.token_hex(32), end="")' > "$SECRET_FILE")
fi
chmod 600 "$SECRET_FILE"
MLFLOW_PASSWORD=$(cat "$MLFLOW_PASSWORD_FILE")
(umask 077; cat >"$MLFLOW_AUTH_INI" <<EOF
[mlflow]
default_permission = NO_PERMISSIONS
database_uri = sqlite:///$RUN_DIR/mlflow/basic_auth.db
admin_username = $MLFLOW_USER
admin_password = $MLFLOW_PASSWORD
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
EOF
)
export MLFLOW_TRACKING_USERNAME=$MLFLOW_USER MLFLOW_TRACKING_PASSWORD=$MLFLOW_PASSWORD

# ---------------------------------------------------------------- MLflow tracking server
if alive "$RUN_DIR/mlflow.pid"; then
  say "MLflow server already running (session $(cat "$RUN_DIR/mlflow.pid"))"
else
  say "starting MLflow server on $MLFLOW_URI (log $LOGS/mlflow.log)"
  MLFLOW_AUTH_CONFIG_PATH=$MLFLOW_AUTH_INI MLFLOW_FLASK_SERVER_SECRET_KEY=$(cat "$SECRET_FILE") nohup setsid "$BIN/mlflow" server --app-name basic-auth --host 127.0.0.1 --port "$MLFLOW_PORT" --workers 1 \
    --backend-store-uri "sqlite:///$RUN_DIR/mlflow/mlflow.db" \
    --artifacts-destination "$RUN_DIR/mlflow/artifacts" --serve-artifacts \
    >"$LOGS/mlflow.log" 2>&1 </dev/null &
  echo $! >"$RUN_DIR/mlflow.pid"
fi

# ---------------------------------------------------------------- Ray head
# `ray start` (in its own session) starts the head's daemons and exits; they stay in that session, which is
# what down.sh stops. The temp dir is our own: ray.init() elsewhere on the machine does not find this cluster
# through /tmp/ray/ray_current_cluster, and down.sh can find strays by it.
if alive "$RUN_DIR/ray.pid"; then
  say "Ray head already running (session $(cat "$RUN_DIR/ray.pid"))"
else
  say "starting Ray head on 127.0.0.1:$RAY_PORT, dashboard $DASHBOARD_URL (log $LOGS/ray-head.log)"
  echo "$RAY_TMP" >"$RUN_DIR/ray_temp_dir"
  # Jobs inherit the head's environment: `python` in an entrypoint is this interpreter (PATH), and
  # MLFLOW_TRACKING_URI (and the credentials exported above) point them at the server above.
  PATH=$BIN:$PATH MLFLOW_TRACKING_URI=$MLFLOW_URI setsid "$BIN/ray" start --head --disable-usage-stats \
    --node-ip-address 127.0.0.1 --port "$RAY_PORT" \
    --dashboard-host 127.0.0.1 --dashboard-port "$DASHBOARD_PORT" \
    --temp-dir "$RAY_TMP" ${FOVEATE_RAY_NUM_CPUS:+--num-cpus "$FOVEATE_RAY_NUM_CPUS"} \
    ${FOVEATE_RAY_RESOURCES:+--resources "$FOVEATE_RAY_RESOURCES"} \
    ${FOVEATE_RAY_CLIENT_PORT:+--ray-client-server-port "$FOVEATE_RAY_CLIENT_PORT"} \
    ${FOVEATE_AGENT_PORT:+--dashboard-agent-listen-port "$FOVEATE_AGENT_PORT"} \
    >"$LOGS/ray-head.log" 2>&1 </dev/null &
  RAY_START_PID=$!
  echo $RAY_START_PID >"$RUN_DIR/ray.pid"
fi

# ---------------------------------------------------------------- wait until both answer
wait_for() {  # name pidfile log url [curl args...]
  local name=$1 pidfile=$2 log=$3 url=$4; shift 4
  local t0=$SECONDS
  until curl -sf -o /dev/null --max-time 5 "$@" "$url"; do
    if ! alive "$pidfile"; then
      say "$name exited during start-up; last lines of $log:"; tail -n 30 "$log" >&2; exit 1
    fi
    if (( SECONDS - t0 > TIMEOUT )); then
      say "$name not ready after ${TIMEOUT}s; last lines of $log:"; tail -n 30 "$log" >&2; exit 1
    fi
    sleep 1
  done
  say "$name ready ($url, $((SECONDS - t0))s)"
}
wait_for "MLflow server" "$RUN_DIR/mlflow.pid" "$LOGS/mlflow.log" "$MLFLOW_URI/health"
if [ -n "${RAY_START_PID:-}" ] && ! wait "$RAY_START_PID"; then
  say "ray start failed; last lines of $LOGS/ray-head.log:"; tail -n 30 "$LOGS/ray-head.log" >&2; exit 1
fi
wait_for "Ray job API" "$RUN_DIR/ray.pid" "$LOGS/ray-head.log" "$DASHBOARD_URL/api/jobs/" \
  -H "Authorization: Bearer $(cat "$TOKEN_FILE")"

# ---------------------------------------------------------------- the client environment
cat >"$RUN_DIR/env.sh" <<EOF
export RAY_ADDRESS=$DASHBOARD_URL
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$TOKEN_FILE
export MLFLOW_TRACKING_URI=$MLFLOW_URI
export MLFLOW_TRACKING_USERNAME=$MLFLOW_USER
export MLFLOW_TRACKING_PASSWORD=$MLFLOW_PASSWORD
export RAY_USAGE_STATS_ENABLED=0
EOF
chmod 600 "$RUN_DIR/env.sh"
say "Ray dashboard: $DASHBOARD_URL (log in with the token in $TOKEN_FILE)"
say "MLflow UI:     $MLFLOW_URI (user $MLFLOW_USER, password in $MLFLOW_PASSWORD_FILE)"
say "client environment (also in $RUN_DIR/env.sh):"
cat "$RUN_DIR/env.sh"
