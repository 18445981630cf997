#!/usr/bin/env bash
# Stop what infra/local/up.sh started from this run directory (and nothing else: no `ray stop`, which
# would stop every Ray instance on the machine). Idempotent. Data (MLflow db, artifacts, logs, token)
# stays in the run directory; pass --purge to delete it as well.
#
#   bash infra/local/down.sh [--purge]
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
RUN_DIR=${FOVEATE_RUN_DIR:-$ROOT/runs/local}
TIMEOUT=${FOVEATE_DOWN_TIMEOUT:-10}  # grace period before SIGKILL (`ray stop` uses 16 s; gcs_server and the
# autoscaler monitor of a lone head do not exit on SIGTERM by themselves)
say() { echo "down.sh: $*" >&2; }

if [ ! -d "$RUN_DIR" ]; then say "nothing to stop ($RUN_DIR does not exist)"; exit 0; fi
RUN_DIR=$(cd "$RUN_DIR" && pwd)

# PIDs of processes whose command line mentions $1 (the head's own temp dir): the Ray processes that
# outlive their parent if it was killed hard.
pids_mentioning() {
  local needle=$1 p
  for p in /proc/[0-9]*; do
    [ -r "$p/cmdline" ] || continue
    if tr '\0' ' ' <"$p/cmdline" 2>/dev/null | grep -qF -- "$needle"; then echo "${p#/proc/}"; fi
  done
}

stop_pid() {  # name pid: SIGTERM, wait, then SIGKILL
  local name=$1 pid=$2 t0=$SECONDS
  kill -0 "$pid" 2>/dev/null || return 0
  say "stopping $name (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null; do
    if (( SECONDS - t0 > TIMEOUT )); then
      say "$name (pid $pid) still running after ${TIMEOUT}s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      break
    fi
    sleep 0.5
  done
}

# live (non-zombie) processes of session $1
session_pids() { ps -o pid=,stat= -s "$1" 2>/dev/null | awk '$2 !~ /^Z/ {print $1}' || true; }

stop_group() {  # name pidfile: started with setsid, so its PID is the session (and process group) of all it spawned
  local name=$1 pidfile=$2 pid t0=$SECONDS
  [ -f "$pidfile" ] || { say "$name: no pid file"; return 0; }
  pid=$(cat "$pidfile")
  if [ -z "$(session_pids "$pid")" ]; then
    say "$name (pid $pid) not running"
  else
    say "stopping $name (session $pid: $(session_pids "$pid" | wc -l) processes)"
    kill -TERM -- "-$pid" 2>/dev/null || true   # the whole process group at once, like `ray stop` per process
    while [ -n "$(session_pids "$pid")" ]; do
      if (( SECONDS - t0 > TIMEOUT )); then
        say "$name: processes still running after ${TIMEOUT}s; sending SIGKILL"
        for p in $(session_pids "$pid"); do kill -KILL "$p" 2>/dev/null || true; done
        break
      fi
      sleep 0.5
    done
  fi
  rm -f "$pidfile"
}

stop_group "Ray head" "$RUN_DIR/ray.pid"   # SIGTERM to every Ray process, like `ray stop` (which would stop them all)
if [ -f "$RUN_DIR/ray_temp_dir" ]; then
  RAY_TMP=$(cat "$RUN_DIR/ray_temp_dir")
  for pid in $(pids_mentioning "$RAY_TMP/"); do
    [ "$pid" = "$$" ] && continue
    stop_pid "leftover Ray process" "$pid"
  done
fi
stop_group "MLflow server" "$RUN_DIR/mlflow.pid"
rm -f "$RUN_DIR/env.sh"

if [ "${1:-}" = "--purge" ]; then
  [ -n "${RAY_TMP:-}" ] && rm -rf "$RAY_TMP"
  rm -rf "$RUN_DIR"
  say "removed $RUN_DIR"
fi
say "stopped"
