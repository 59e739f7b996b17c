#!/usr/bin/env bash
# Launch the Fashion-MNIST training job under msrun: what the container image and Kubernetes call.
#
# Usage: ./run.sh [main.py flags...]      e.g.  ./run.sh --epochs 3 --data-dir /data
#
# Environment (all optional; every main.py setting also has one, see `python main.py --help`):
#   WORKERS      workers on this node; default: the visible Ascend devices, else 2 CPU workers
#   NODES        nodes in the job (default 1)
#   NODE_RANK    this node's index, 0..NODES-1; default JOB_COMPLETION_INDEX (a Kubernetes Indexed Job), else 0
#   MASTER_ADDR  host of node 0, where msrun's scheduler listens (default 127.0.0.1; required when NODES > 1)
#   MASTER_PORT  scheduler port; default a free port on a single node, 8118 across nodes
#   OUTPUT_DIR   where summary.json and PNGs go (default outputs); msrun's logs go to LOG_DIR
#   LOG_DIR      per-worker logs (default $OUTPUT_DIR/logs, and $OUTPUT_DIR/logs/nodeN across nodes)
#   CLUSTER_TIMEOUT  seconds msrun waits for all nodes to join (default 600)
#   GLOG_v       MindSpore's C++ log level: 3 (errors only, the default here) keeps the console readable;
#                2 adds warnings
#   DRY_RUN      1: print the msrun command this node would run, and exit
#   ASCEND_ENV   CANN's environment script, sourced when present
#                (default /usr/local/Ascend/ascend-toolkit/set_env.sh)
#
# Exit status: 0 when every worker succeeded; else the failing worker's own status (2: bad settings or data,
# 3: the training diverged, 4: a volume is full; 128+N for a worker killed by signal N, 147 for one stopped by
# SIGSTOP), or msrun's. The failing worker's log tail is shown; a worker that fails or stays stopped ends the
# whole job at once. SIGTERM or SIGINT stops the workers together at their next log interval, and run.sh
# exits 143 (130): as a container's PID 1 too, where bash would otherwise ignore SIGTERM.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "run.sh: $*" >&2; exit 2; }

count_ascend_devices() {
  # The Ascend device plugin and docker's --device both expose /dev/davinciN; the runtime's variable
  # narrows them when set.
  local visible=${ASCEND_RT_VISIBLE_DEVICES:-${ASCEND_VISIBLE_DEVICES:-}}
  if [[ -n "$visible" ]]; then
    tr ',' '\n' <<<"$visible" | grep -c .
  else
    find /dev -maxdepth 1 -name 'davinci[0-9]*' 2>/dev/null | wc -l
  fi
}

free_port() {
  python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'
}

signal_status() {
  # A worker's exit as a shell status: msrun reports death by signal N as -N.
  if (($1 < 0)); then echo $((128 - $1)); else echo "$1"; fi
}

describe_exit() {
  # msrun reports a worker's exit code; a negative one is the signal that ended it.
  case "$1" in
    -9) echo "was killed by SIGKILL (kill -9, or the out-of-memory killer: check the memory limit)" ;;
    -15) echo "was stopped by SIGTERM" ;;
    -*) echo "was killed by signal ${1#-}" ;;
    2) echo "exited with status 2: a bad setting or missing data" ;;
    3) echo "exited with status 3: the training diverged" ;;
    4) echo "exited with status 4: a volume it writes to is full" ;;
    *) echo "exited with status $1" ;;
  esac
}

show_tail() {
  # The end of a worker log, without MindSpore's own INFO and WARNING lines.
  echo "run.sh: $1" >&2
  grep -vE '^\[(WARNING|INFO)\]' "$2" | tail -n 15 | sed 's/^/    /' >&2
}

worker_log_of() {
  # The log of the worker with this pid: each worker names its pid in its first line (main.py).
  grep -l "(pid $1)" "$2"/worker_*.log 2>/dev/null | head -n 1 || true
}

report_failure() {
  # msrun itself only says "check logs": name the worker that failed, say how, and show why. Sets
  # worker_status to the first failed worker's status.
  local status=$1 log_dir=$2 pid code log found=0
  if ((ended_early)); then
    echo "run.sh: the job failed; run.sh ended the other workers at once" >&2
  else
    echo "run.sh: the job failed (msrun exit status $status)" >&2
  fi
  while read -r pid code; do
    : "${worker_status:=$(signal_status "$code")}"
    log=$(worker_log_of "$pid" "$log_dir")
    echo "run.sh: ${log:+${log##*/}, }process $pid $(describe_exit "$code")" >&2
    if [[ -n "$log" ]]; then
      found=1
      show_tail "the last lines of ${log##*/}:" "$log"
    fi
  done < <(sed -n 's/.*Worker process \([0-9]*\) exit with exception\. Error code: \(-\{0,1\}[0-9]*\)\..*/\1 \2/p' \
             "$log_dir/msrun.log")
  if ((!found)); then
    for log in "$log_dir"/worker_*.log; do
      grep -qE 'Traceback|ERROR' "$log" 2>/dev/null || continue
      show_tail "${log##*/} reports an error; its last lines:" "$log"
    done
  fi
  echo "run.sh: all logs are in $log_dir" >&2
}

children_of() {
  # The kernel's own list (no procps: slim images lack pgrep).
  cat "/proc/$1/task/"*/children 2>/dev/null || true
}

workers_of() {
  # msrun's worker processes (not its scheduler or log tails), by the role msrun gives them.
  local pid
  for pid in $(children_of "$1"); do
    if tr '\0' '\n' 2>/dev/null <"/proc/$pid/environ" | grep -qx 'MS_ROLE=MS_WORKER'; then
      echo "$pid"
    fi
  done
}

request_stop() {
  # msrun would SIGKILL its workers on SIGINT and orphan them on SIGTERM (each runs in a session of its own),
  # so the workers get SIGTERM themselves; they agree to stop at their next log interval, rank 0 marks the
  # MLflow run KILLED, and the newest checkpoint stays for the next start.
  stop_status=$1
  echo "run.sh: signal received: stopping the workers at their next log interval" >&2
  local pid
  for pid in $(workers_of "$msrun_pid"); do
    kill -TERM "$pid" 2>/dev/null || true
  done
}

process_state() {
  # A process's state letter from the kernel (R, S, T, Z, ...), or nothing once it is gone; never fails.
  local stat
  { read -r stat <"/proc/$1/stat"; } 2>/dev/null || return 0
  stat=${stat##*) }
  echo "${stat%% *}"
}

stopped_worker() {
  # A worker stopped by SIGSTOP (or held by a debugger) freezes every rank at its next collective, and msrun
  # would only notice when its heartbeat times out: print the first such worker's pid.
  local pid state
  for pid in $(workers_of "$1"); do
    state=$(process_state "$pid")
    if [[ "$state" == [Tt] ]]; then
      echo "$pid"
      return
    fi
  done
}

without_launcher_traceback() {
  # msrun ends a failed job with a Python traceback of its own ("RuntimeError: Distributed job exited with
  # exception. Please check logs"), which says nothing report_failure does not say better; every other line
  # (but INFO lines under GLOG_v 2 or 3), and every other traceback, passes at once, line by line. Ctrl-C is
  # for run.sh alone (it would break msrun's pipe).
  trap '' INT
  local line held=()
  while IFS= read -r line || [[ -n "$line" ]]; do
    if [[ "$line" == "Traceback (most recent call last):" ]]; then
      held=("$line")
    elif ((${#held[@]})) && [[ "$line" == " "* ]]; then
      held+=("$line")
    elif ((${#held[@]})) && [[ "$line" == "RuntimeError: Distributed job exited with exception"* ]]; then
      held=()
    elif [[ "$line" == "[INFO] "* ]] && ((GLOG_v > 1)); then
      # MindSpore's RPC threads started as a worker leaves its cluster log at INFO whatever GLOG_v says
      # ("Event base dispatch success!"); the worker's log file keeps them.
      continue
    else
      if ((${#held[@]})); then printf '%s\n' "${held[@]}"; fi
      printf '%s\n' "$line"
      held=()
    fi
  done
  if ((${#held[@]})); then printf '%s\n' "${held[@]}"; fi
}

end_msrun() {
  # msrun's workers and scheduler are its children, each in a session of its own. SIGKILL takes a moment to
  # free a worker's memory: run.sh ends only when they are gone (or zombies), so nothing outlives it.
  local pids pid state living
  pids=$(children_of "$1")
  # shellcheck disable=SC2086  # one pid per word
  kill -KILL $pids "$1" 2>/dev/null || true
  for _ in $(seq 100); do
    living=0
    for pid in $pids; do
      state=$(process_state "$pid")
      if [[ -n "$state" && "$state" != Z ]]; then living=1; fi
    done
    ((living)) || return 0
    sleep 0.1
  done
}

command -v msrun >/dev/null || die "msrun not found: activate the environment with MindSpore installed (see README)"
command -v python >/dev/null || die "python not found on PATH: msrun launches 'python'; activate the venv first"

: "${ASCEND_ENV:=/usr/local/Ascend/ascend-toolkit/set_env.sh}"
if [[ -f "$ASCEND_ENV" ]]; then
  set +u  # CANN's script reads variables that may be unset
  # shellcheck source=/dev/null
  source "$ASCEND_ENV"
  set -u
fi
export GLOG_v=${GLOG_v:-3}

: "${NODES:=1}"
: "${NODE_RANK:=${JOB_COMPLETION_INDEX:-0}}"
: "${CLUSTER_TIMEOUT:=600}"
if [[ -z "${WORKERS:-}" ]]; then
  WORKERS=$(count_ascend_devices)
  ((WORKERS > 0)) || WORKERS=2
fi
export LOCAL_WORKERS=$WORKERS  # main.py divides this machine's cores among its workers
export NODE_RANK  # main.py names this node's system metrics after it
if [[ -z "${MASTER_PORT:-}" ]]; then
  if ((NODES > 1)); then MASTER_PORT=8118; else MASTER_PORT=$(free_port); fi
fi
for var in WORKERS NODES NODE_RANK MASTER_PORT CLUSTER_TIMEOUT; do
  [[ "${!var}" =~ ^[0-9]+$ ]] || die "$var must be a whole number, got '${!var}'"
done
((WORKERS >= 1 && NODES >= 1)) || die "WORKERS and NODES must be at least 1"
((NODE_RANK < NODES)) || die "NODE_RANK ($NODE_RANK) must be below NODES ($NODES)"
if ((NODES > 1)) && [[ -z "${MASTER_ADDR:-}" ]]; then
  die "NODES=$NODES needs MASTER_ADDR, the address of node 0"
fi
: "${MASTER_ADDR:=127.0.0.1}"

# The job's own checks, in a fraction of a second and before msrun starts anything: a bad setting, a directory
# it cannot write, a batch the data cannot fill, or an output directory another job holds (whose logs msrun
# would overwrite) stops here with the job's one-line error and exit 2. It prints the output directory.
case " $* " in *" -h "* | *" --help "*) exec python "$here/main.py" --help ;; esac
output_dir=$(PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}" python -m fmnist.preflight "$((WORKERS * NODES))" "$@") ||
  exit "$?"
if ((NODES > 1)); then
  : "${LOG_DIR:=$output_dir/logs/node$NODE_RANK}"  # msrun names logs by local rank: keep nodes apart
else
  : "${LOG_DIR:=$output_dir/logs}"
fi
launcher=(
  msrun
  "--worker_num=$((WORKERS * NODES))"
  "--local_worker_num=$WORKERS"
  "--master_addr=$MASTER_ADDR"
  "--master_port=$MASTER_PORT"
  "--node_rank=$NODE_RANK"
  "--log_dir=$LOG_DIR"
  "--cluster_time_out=$CLUSTER_TIMEOUT"
  --join=True
)
if [[ "${DRY_RUN:-0}" == 1 ]]; then
  printf '%q ' "${launcher[@]}" python "$here/main.py" "$@"
  echo
  exit 0
fi
mkdir -p "$LOG_DIR"
echo "run.sh: node $NODE_RANK of $NODES, $WORKERS worker(s) here, scheduler $MASTER_ADDR:$MASTER_PORT, logs in $LOG_DIR"

status=0 stop_status=0 worker_status="" ended_early=0 frozen="" stopped_polls=0
freeze_polls=10  # stopped for 5 s on end (polls of 0.5 s): a profiler's or debugger's attachment is not a freeze
trap 'request_stop 143' TERM
trap 'request_stop 130' INT
: >"$LOG_DIR/msrun.log"  # before the watch below reads it: the last run's failure is not this one's
# msrun in a session of its own, so that a terminal's Ctrl-C reaches run.sh alone (tee -i ignores it too).
setsid "${launcher[@]}" python "$here/main.py" "$@" > >(without_launcher_traceback | tee -i "$LOG_DIR/msrun.log") 2>&1 &
msrun_pid=$!
# When a worker fails, msrun logs it within seconds but ends the others only when its scheduler's heartbeat
# times out (about 40 s on CPU), and the scheduler then prints a traceback of its own. The first failed worker
# in msrun's log ends the job here at once instead.
while kill -0 "$msrun_pid" 2>/dev/null && ((!stop_status)); do
  frozen=$(stopped_worker "$msrun_pid")
  if [[ -n "$frozen" ]]; then stopped_polls=$((stopped_polls + 1)); else stopped_polls=0; fi
  if ((stopped_polls >= freeze_polls)) ||
    grep -q 'Worker process [0-9]* exit with exception' "$LOG_DIR/msrun.log" 2>/dev/null; then
    ended_early=1
    end_msrun "$msrun_pid"
    break
  fi
  sleep 0.5 &
  wait $! || true  # returns at once when a trapped signal arrives
done
if ((!stop_status)); then
  wait "$msrun_pid" 2>/dev/null || status=$?  # at once: msrun has ended; no "Killed" notice from bash
fi
if ((stop_status)); then
  for _ in $(seq 60); do  # the workers take a log interval and MLflow's last request; Kubernetes gives 30 s
    [[ -z "$(workers_of "$msrun_pid")" ]] && break
    sleep 0.5
  done
  end_msrun "$msrun_pid"  # msrun's scheduler waits out a heartbeat timeout otherwise
  wait "$msrun_pid" 2>/dev/null || true
  echo "run.sh: stopped; run the same command again to resume from the newest checkpoint" >&2
  exit "$stop_status"
fi
if ((stopped_polls >= freeze_polls)); then
  log=$(worker_log_of "$frozen" "$LOG_DIR")
  echo "run.sh: the job failed: ${log:+${log##*/}, }process $frozen was stopped (SIGSTOP, or a debugger) and" \
    "froze every rank; run.sh ended the job. All logs are in $LOG_DIR" >&2
  exit $((128 + 19))
fi
if ((status != 0)); then
  report_failure "$status" "$LOG_DIR"
  exit "${worker_status:-$status}"
fi
if ((NODE_RANK == 0)); then
  echo "run.sh: done. Results: $output_dir/summary.json; pictures: $output_dir/*.png; logs: $LOG_DIR"
else
  echo "run.sh: done. Node 0 holds the results; logs of this node: $LOG_DIR"
fi
